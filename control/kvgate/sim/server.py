"""The simulator's HTTP server: vLLM's OpenAI-compatible API surface on aiohttp.

Endpoints (shapes follow vLLM's ``vllm/entrypoints/openai/api_server.py``):

* ``POST /v1/chat/completions``, ``POST /v1/completions``: JSON or SSE (``stream: true``).
* ``POST /v1/embeddings``: OpenAI's embeddings (deterministic unit vectors, see :func:`embedding`).
* ``GET /v1/models``, ``GET /health``, ``GET /health_generate``, ``GET /version``,
  ``POST /reset_prefix_cache``, ``GET /metrics`` (Prometheus text).
* Probe endpoints other engines expose, so node discovery can ask any of them:
  ``/model_info``, ``/get_model_info``, ``/server_info``, ``/get_server_info``.

Every response carries ``X-Kvgate-Sim-Node: <node_id>``. Errors use the OpenAI body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import random
import struct
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from aiohttp import web

from ..policy.model import SimulatorConfig
from .engine import Engine, Sequence, output_rng
from .tokenizer import tokenize, tokenize_chat

log = logging.getLogger("kvgate.sim")

DEFAULT_MAX_TOKENS = 64
DEFAULT_MAX_MODEL_LEN = 131072
NODE_HEADER = "X-Kvgate-Sim-Node"
SIM_VERSION = "0.0.0+kvgate.sim"

ENGINE_KEY = web.AppKey("engine", Engine)
SETTINGS_KEY = web.AppKey("settings", dict)


class ApiError(Exception):
    """An OpenAI-style error response: HTTP ``code``, ``type`` and optional ``param``."""

    def __init__(self, code: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.type, self.param = code, message, type_, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.code)


# ------------------------------------------------------------------ request parsing
async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _int_field(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}.", param=name)
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


@dataclass
class _Params:
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    deterministic: bool
    seed: int | None


def _common_params(app: web.Application, body: dict, prompt_len: int) -> _Params:
    settings = app[SETTINGS_KEY]
    served = app[ENGINE_KEY].config.model
    model = body.get("model") or served
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise ApiError(400, "The simulator supports only n=1.", param="n")
    max_tokens = _int_field(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", settings["default_max_tokens"], 1)
    max_len = settings["max_model_len"]
    if prompt_len + max_tokens > max_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise ApiError(400, f"temperature must be a number, got {temperature!r}.", param="temperature")
    seed = _int_field(body, "seed", None, -(2**63))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object.", param="stream_options")
    stream = bool(body.get("stream", False))
    return _Params(
        model=served,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream and bool(stream_options.get("include_usage", False)),
        deterministic=temperature is not None and temperature == 0,
        seed=seed,
    )


def _completion_prompt(body: dict) -> list[str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tokenize("\n".join(prompt))
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [str(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids.", param="prompt")


# ------------------------------------------------------------------- response shapes
def _usage(seq: Sequence) -> dict:
    prompt, completion = len(seq.prompt_tokens), len(seq.output_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
    }


def _text(words: list[str], first: bool) -> str:
    # Words are joined by single spaces, so tokenize(output) gives back exactly the output tokens.
    joined = " ".join(words)
    return joined if first else " " + joined


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _run(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    engine = app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ApiError(400, "messages must be a non-empty list of message objects.", param="messages")
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise ApiError(400, "tools must be a list.", param="tools")
            prompt_tokens = tokenize_chat(messages, tools)
        else:
            prompt_tokens = _completion_prompt(body)
            if not prompt_tokens:
                raise ApiError(400, "The prompt cannot be empty.", param="prompt")
        params = _common_params(app, body, len(prompt_tokens))
    except ApiError as e:
        return e.response()

    seq = Sequence(prompt_tokens=prompt_tokens, max_tokens=params.max_tokens,
                   rng=output_rng(prompt_tokens, params.seed, params.deterministic))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    if not params.stream:
        async with contextlib.aclosing(engine.generate(seq, None)) as gen:
            async for _ in gen:
                pass
        text = " ".join(seq.output_tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": seq.finish_reason, "stop_reason": None}
        return web.json_response({"id": rid, "object": obj, "created": created, "model": params.model,
                                  "choices": [choice], "usage": _usage(seq)})

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": rid, "object": chunk_obj, "created": created, "model": params.model}

    def chunk(choice: dict) -> bytes:
        out = dict(base, choices=[choice])
        if params.include_usage:
            out["usage"] = None
        return _sse(out)

    try:
        async with contextlib.aclosing(engine.generate(seq, app[ENGINE_KEY].config.stream_interval)) as gen:
            first = True
            async for words in gen:
                finish = seq.finish_reason if len(seq.output_tokens) >= seq.max_tokens else None
                if chat:
                    if first:
                        await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}))
                    await resp.write(chunk({"index": 0, "delta": {"content": _text(words, first)},
                                            "logprobs": None, "finish_reason": finish}))
                else:
                    await resp.write(chunk({"index": 0, "text": _text(words, first), "logprobs": None,
                                            "finish_reason": finish, "stop_reason": None}))
                first = False
        if params.include_usage:
            await resp.write(_sse(dict(base, choices=[], usage=_usage(seq))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        # The client went away mid-stream (without handler cancellation a write fails instead):
        # aclosing has already aborted the sequence and released its slot and blocks.
        pass
    return resp


# ------------------------------------------------------------------------ embeddings
EMBEDDING_DIMENSIONS = 384
"""Length of a simulated embedding unless the request asks for ``dimensions`` (all-MiniLM-L6-v2's)."""
MAX_EMBEDDING_DIMENSIONS = 4096


def embedding(tokens: list[str], dimensions: int = EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector (L2 norm 1) of ``dimensions`` floats for one input's tokens:
    Gaussian components seeded by ``sha256("\x00".join(tokens))``. The same input always gives
    the same vector; different inputs give nearly orthogonal ones (no meaning is simulated)."""
    seed = int.from_bytes(hashlib.sha256("\x00".join(tokens).encode("utf-8")).digest()[:8], "big")
    rng = random.Random(seed)
    v = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def _embedding_inputs(body: dict) -> list[list[str]]:
    """The token lists of ``input`` (a string, [string], [int] or [[int]]); ApiError 400 otherwise."""
    inp = body.get("input")
    err = ApiError(400, "input must be a non-empty string, a list of strings, a list of token ids or a list of "
                   "lists of token ids.", param="input")

    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(inp, str):
        out = [tokenize(inp)]
    elif isinstance(inp, list) and inp and all(isinstance(x, str) for x in inp):
        out = [tokenize(x) for x in inp]
    elif ids(inp):
        out = [[str(t) for t in inp]]
    elif isinstance(inp, list) and inp and all(ids(x) for x in inp):
        out = [[str(t) for t in x] for x in inp]
    else:
        raise err
    if any(not tokens for tokens in out):
        raise ApiError(400, "An input cannot be empty.", param="input")
    return out


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: ``{model, input, encoding_format?, dimensions?, user?}`` →
    ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage": {"prompt_tokens", "total_tokens"}}``; ``embedding`` is a list of floats, or with
    ``encoding_format: "base64"`` the base64 of its little-endian float32s (OpenAI's form).
    Costs its prefill in the engine (:meth:`Engine.embed`)."""
    app = request.app
    engine = app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        served = engine.config.model
        model = body.get("model") or served
        if model != served:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        inputs = _embedding_inputs(body)
        dims = _int_field(body, "dimensions", EMBEDDING_DIMENSIONS, 1)
        assert dims is not None
        if dims > MAX_EMBEDDING_DIMENSIONS:
            raise ApiError(400, f"dimensions must be at most {MAX_EMBEDDING_DIMENSIONS}.", param="dimensions")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, "encoding_format must be 'float' or 'base64'.", param="encoding_format")
        max_len = app[SETTINGS_KEY]["max_model_len"]
        for tokens in inputs:
            if len(tokens) > max_len:
                raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                               f"requested {len(tokens)} tokens in the input for embedding generation. Please "
                               "reduce the length of the input.")
    except ApiError as e:
        return e.response()
    total = sum(len(t) for t in inputs)
    await engine.embed(total)
    data = []
    for i, tokens in enumerate(inputs):
        vec = embedding(tokens, dims)
        value: Any = vec
        if fmt == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": value})
    # usage last, as vLLM and OpenAI send it (the gateway reads it from the answer's end)
    return web.json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": engine.config.model, "data": data,
                              "usage": {"prompt_tokens": total, "total_tokens": total}})


# -------------------------------------------------------------------------- handlers
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=False)


async def models(request: web.Request) -> web.Response:
    model = request.app[ENGINE_KEY].config.model
    return web.json_response({"object": "list", "data": [{
        "id": model, "object": "model", "created": request.app[SETTINGS_KEY]["created"], "owned_by": "vllm",
        "root": model, "parent": None, "max_model_len": request.app[SETTINGS_KEY]["max_model_len"],
    }]})


async def empty_ok(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].reset_prefix_cache()
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    model = request.app[ENGINE_KEY].config.model
    return web.json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = engine.config
    return web.json_response({
        "dp_size": 1, "tp_size": 1, "model": cfg.model, "node_id": request.app[SETTINGS_KEY]["node_id"],
        "max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size, "num_gpu_blocks": cfg.num_gpu_blocks,
        "max_model_len": request.app[SETTINGS_KEY]["max_model_len"], "engine": "kvgate-sim",
        "version": SIM_VERSION,
    })


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(body=engine.metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, e.reason, type(e).__name__.removeprefix("HTTP") + "Error").response()


def create_app(config: SimulatorConfig, node_id: str = "sim", *, prefill_slots: int = 1,
               max_model_len: int = DEFAULT_MAX_MODEL_LEN,
               default_max_tokens: int = DEFAULT_MAX_TOKENS) -> web.Application:
    """Build the simulator's aiohttp application (one engine, its own metrics registry).

    Args:
        config: engine settings (model name, latency model, KV-cache geometry).
        node_id: echoed in the ``X-Kvgate-Sim-Node`` header of every response.
        prefill_slots: prefills that run at once (1 = serialised, the default).
        max_model_len: longest prompt + completion in tokens (reported by ``/v1/models``; longer → 400).
        default_max_tokens: completion length when a request sets neither ``max_tokens`` nor
            ``max_completion_tokens``.

    The engine must be used from the loop the app runs on (its queue uses that loop's futures).
    """
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[SETTINGS_KEY] = {"node_id": node_id, "max_model_len": max_model_len,
                         "default_max_tokens": default_max_tokens, "created": int(time.time())}

    async def _start(app: web.Application) -> None:
        # asyncio primitives bind to the running loop, so the engine is built on startup.
        app[ENGINE_KEY] = Engine(config, prefill_slots=prefill_slots)

    async def _node_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[NODE_HEADER] = node_id

    app.on_startup.append(_start)
    app.on_response_prepare.append(_node_header)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", empty_ok)
    app.router.add_get("/health_generate", empty_ok)
    app.router.add_get("/version", version)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/metrics", metrics)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    return app


def serve(host: str, port: int, config: SimulatorConfig, node_id: str = "sim", *, access_log: bool = False,
          **app_options: Any) -> None:
    """Serve the simulator on ``host:port`` until interrupted (blocking).

    ``access_log`` logs every request on the ``aiohttp.access`` logger (off by default: the
    demo sends thousands); ``app_options`` go to :func:`create_app`. Client disconnects cancel their handler, which
    aborts the request and frees its sequence slot and blocks.
    """
    app = create_app(config, node_id, **app_options)
    log.info("kvgate sim %s serving %s on http://%s:%d", node_id, config.model, host, port)
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True,
                access_log=logging.getLogger("aiohttp.access") if access_log else None)


class SimServerThread:
    """A simulator on a background thread with its own event loop (tests, benchmarks, notebooks).

    Usage::

        with SimServerThread(SimulatorConfig(time_scale=0.01)) as sim:
            openai.OpenAI(base_url=sim.url + "/v1", api_key="x")

    Args:
        config, node_id, app_options: as for :func:`create_app`.
        host: interface to bind. port: 0 picks a free port (see :attr:`port` after start).

    Raises:
        RuntimeError: the server did not start within 10 s.
    """

    def __init__(self, config: SimulatorConfig, node_id: str = "sim", host: str = "127.0.0.1", port: int = 0,
                 **app_options: Any):
        self.config, self.node_id, self.host, self.port = config, node_id, host, port
        self.app = create_app(config, node_id, **app_options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"kvgate-sim-{node_id}", daemon=True)

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        """The engine (read it from tests; mutate it only via ``call``)."""
        return self.app[ENGINE_KEY]

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def start(self) -> "SimServerThread":
        self._thread.start()
        if not self._ready.wait(10) or self._error:
            raise RuntimeError(f"simulator {self.node_id} did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "SimServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(config: SimulatorConfig, node_id: str = "sim", **kwargs: Any) -> Iterator[SimServerThread]:
    """``with running(config) as sim: ...`` — a :class:`SimServerThread`, stopped on exit."""
    with SimServerThread(config, node_id, **kwargs) as sim:
        yield sim
