# kvgate: one image for every service of docker-compose.yml (Redis, the nginx gateway, the
# control plane, the engine simulators and the node agents); each service picks its command.
# It installs exactly what `make setup` installs, with the same script, less the test extras.
#   docker build -t kvgate:local .        (or: docker compose build)

# The admin page's chart library (uPlot, pinned by web/package-lock.json), fetched from npm by
# scripts/build-web in a Node stage of its own: the final image gets the vendored files, no Node.
FROM node:20-bookworm-slim AS web
WORKDIR /opt/kvgate
COPY web/package.json web/package-lock.json web/
COPY scripts/build-web scripts/build-web
RUN bash scripts/build-web

FROM debian:bookworm-slim

LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="Cache-affinity gateway for fleets of OpenAI-compatible LLM inference servers" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/kvgate

# Debian packages first, in a layer of their own: it is rebuilt only when the script changes,
# not on every source change. No test extras: the image runs no browser (no Chromium, no
# `playwright install`).
COPY scripts/setup scripts/setup
RUN bash scripts/setup --no-venv --no-test-extras \
    && rm -rf /var/lib/apt/lists/*

# The source tree, the vendored chart library from the web stage (.dockerignore keeps the
# host's copy out), then the venv: an editable install of this tree (see scripts/setup; the
# renderer finds nginx/ and lua/ through kvgate.paths). .dockerignore keeps the host's .venv out.
# --no-web: the web stage did scripts/build-web; --check fails the build if its files are not
# those web/package-lock.json pins (instead of scripts/setup installing npm into the image).
COPY . .
COPY --from=web /opt/kvgate/control/kvgate/web/admin/static/vendor/ control/kvgate/web/admin/static/vendor/
RUN bash scripts/setup --no-test-extras --no-web \
    && bash scripts/build-web --check

ENV PATH=/opt/kvgate/.venv/bin:$PATH

# gateway (client traffic) and control plane (admin API, /metrics); the simulators listen on
# 8000 and Redis on 6379 inside the compose network only.
EXPOSE 8080 9090

CMD ["kvgate", "--help"]
