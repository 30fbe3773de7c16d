# kvgate — the README's two commands: `make demo` (the main job) and `make test` (the tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
KVGATE := $(VENV)/bin/kvgate
TRACE ?= ../shared/traces/mooncake_conversation_trace.jsonl
DEMO_POLICY ?= policies/demo.yaml
DEMO_REQUESTS ?= 2000
DEMO_SPEEDUP ?= 10

# Debian 12 packages (see docs/operations.md): nginx with the Lua module, Debian's resty
# libraries (nginx.redis, nginx.sha256), cjson, Redis, and luajit2 (OpenResty's LuaJIT, the same
# runtime as the Lua module; Debian's plain `luajit` conflicts with it) for the pure-Lua unit tests.
APT_PACKAGES := nginx libnginx-mod-http-lua lua-resty-core lua-resty-lrucache lua-nginx-redis \
	lua-nginx-string lua-cjson redis-server redis-tools luajit2 python3-venv ca-certificates

.PHONY: setup demo test test-unit test-integration up down status clean
.DEFAULT_GOAL := help

help:
	@echo "make setup  install Debian packages and the Python venv (idempotent)"
	@echo "make demo   start the demo stack and replay $(DEMO_REQUESTS) trace requests (round robin vs chash)"
	@echo "make test   run the test suite"
	@echo "make down   stop the demo stack"

setup: $(VENV)/.installed
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV) || { \
	  echo "error: '$(PYTHON) -m venv' failed; install python3-venv first" >&2; exit 1; }
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	@touch $@

demo: setup
	@[ -f "$(TRACE)" ] || { echo "error: trace not found at $(TRACE) (set TRACE=...)" >&2; exit 2; }
	@start=$$(date +%s); \
	$(KVGATE) up $(DEMO_POLICY) && \
	$(KVGATE) replay "$(TRACE)" --requests $(DEMO_REQUESTS) --speedup $(DEMO_SPEEDUP) \
	  --policies round_robin,chash --json demo-report.json && \
	echo && $(KVGATE) status && \
	echo "make demo took $$(( $$(date +%s) - start )) s; the stack keeps running (stop it with 'make down')"

test: setup
	bash scripts/run-tests

up: setup
	$(KVGATE) up $(DEMO_POLICY)

down:
	@[ -x $(KVGATE) ] && $(KVGATE) down || true

status:
	$(KVGATE) status

clean: down
	rm -rf .kvgate demo-report.json .pytest_cache
