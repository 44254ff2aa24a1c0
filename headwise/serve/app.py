"""The FastAPI app: routes (thin: body -> gateway -> response), lifespan, guards.

    app = create_app(load_config("gateway.toml"))     # or default_config()
    uvicorn.run(app, host="127.0.0.1", port=8000)

Startup returns at once and models load in a background thread: /health answers 503
until every local model has loaded or failed, then 200 ("degraded", with each failed
model's reason, when some failed). If every local model fails, the server stops and
`headwise serve` exits 1 with the reasons. Shutdown (SIGTERM, after uvicorn has let
in-flight requests finish) stops the engines.
The four generating routes take their body raw: the gateway validates it with our schemas only
for the targets that need them (passthrough.py); /openapi.json documents the schemas all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from . import errors
from .anthropic import messages as anthropic_messages
from .anthropic import schemas as anthropic_api  # Anthropic's Messages API: serve/anthropic/messages.py
from .anthropic.schemas import MessageResponse
from .config import ServeConfig
from .errors import APIError
from .gateway import Gateway
from .local import LocalRuntime, Loader, default_loader, load_all
from .memory import IdleTrim
from .metrics import Metrics
from . import models_api
from .openai import responses as responses_api
from .middleware import ApiKeyAuth, BodySizeLimit, install_log_filters
from .openai.common import require_peer
from .passthrough import Incoming, documented, read
from .tensor_parallel import check as check_tensor_parallel
from .schemas import ERRORS, ChatCompletion, ChatCompletionChunk, Completion, EmbeddingResponse, sse_docs

log = logging.getLogger("headwise.serve")


class ServeState:
    """Everything a request needs, hung on app.state.serve."""

    def __init__(self, config: ServeConfig, loader: Loader):
        self.config = config
        self.runtimes = {name: LocalRuntime(spec, loader) for name, spec in config.models.items()}
        self.metrics = Metrics(self.runtimes)
        self.client: httpx.AsyncClient | None = None
        self.gateway: Gateway | None = None
        self.started = int(time.time())
        self.fatal: str | None = None  # why the server gave up (every model failed)
        self.stop_server = None  # set by `headwise serve`: ends uvicorn's loop
        self._drain_timer: threading.Timer | None = None
        self.on_loaded: list = []  # callables(runtimes), once every model has loaded or failed (the CLI's banner)
        self.load_done = threading.Event()  # the loader left torch: every model loaded or failed
        self.stop_loading = threading.Event()  # the server stops: models not begun are not loaded
        # freed C heap back to the OS while the engines are idle (serve/memory.py)
        self.idle_trim = IdleTrim(
            lambda: any(rt.engine is not None and rt.engine.has_unfinished() for rt in self.runtimes.values())
        )

    def loaded(self, runtimes) -> None:
        """The loader thread is done: hand the loader's freed buffers back, tell `on_loaded`; with
        local models and none of them ready, give up."""
        self.load_done.set()
        self.idle_trim.trim_now()
        for hook in self.on_loaded:
            try:
                hook(runtimes)
            except Exception:  # a banner must not keep the server from serving
                log.exception("on_loaded hook %r failed", hook)
        if runtimes and all(rt.state == "failed" for rt in runtimes):
            self.fatal = "no model could be loaded: " + "; ".join(f"{rt.name}: {rt.error}" for rt in runtimes)
            log.error("%s; stopping the server", self.fatal)
            if self.stop_server is not None:
                self.stop_server()

    @property
    def draining(self) -> bool:
        return self.gateway is not None and self.gateway.draining

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work (503), let what runs finish; shortly before the drain
        timeout (when uvicorn would cancel them, a traceback each) end the local requests
        still running, so each stream closes with an error event and [DONE]."""
        self.stop_loading.set()
        if self.gateway is not None:
            self.gateway.draining = True
        if self._drain_timer is None:
            timeout = self.config.server.drain_timeout
            self._drain_timer = threading.Timer(max(0.0, timeout - min(1.0, 0.25 * timeout)), self.cut_streams)
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def native_threads(self) -> list[str]:
        """Threads still running that may be inside torch (the loader, an engine step that outlived
        its shutdown's timeout): the process must not finalize under them (cli/startup.py)."""
        names = ("headwise-loader", "headwise-engine")
        return [t.name for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()]

    def kill_followers(self) -> None:
        """SIGKILL every tensor-parallel follower process: for an exit that skips shutdown."""
        for rt in self.runtimes.values():
            group = getattr(rt.tp, "group", None)
            for pid in group.pids().values() if group is not None else ():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def cut_streams(self) -> None:
        n = sum(rt.abort_all() for rt in self.runtimes.values())
        if n:
            log.warning("drain timeout (%g s): ended %d request(s) still running", self.config.server.drain_timeout, n)


def create_app(config: ServeConfig, *, loader: Loader = default_loader) -> FastAPI:
    protect_metrics = config.server.metrics_need_key()  # a ConfigError before anything starts
    for spec in config.models.values():
        check_tensor_parallel(spec)  # N against the KV heads the files name, before anything loads
    install_log_filters()
    state = ServeState(config, loader)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        state.gateway = Gateway(config, state.runtimes, state.client, state.metrics)
        state.gateway.start()
        load_all(list(state.runtimes.values()), on_done=state.loaded, stop=state.stop_loading)
        state.idle_trim.start()
        try:
            yield
        finally:
            state.idle_trim.stop()
            state.stop_loading.set()
            if state.gateway is not None:
                state.gateway.draining = True
            if state._drain_timer is not None:
                state._drain_timer.cancel()  # uvicorn is done waiting: nothing left to cut
            timeout = config.server.drain_timeout
            await asyncio.to_thread(lambda: [rt.shutdown(timeout) for rt in state.runtimes.values()])
            await state.gateway.aclose()
            await state.client.aclose()

    # redirect_slashes=False: "POST /v1/chat/completions/" is a 404 with the envelope, not a 307
    # that clients follow as a GET or not at all
    app = FastAPI(
        title="headwise",
        version=_version(),
        lifespan=lifespan,
        redirect_slashes=False,
        description="OpenAI-compatible API over headwise's engine and upstream providers.",
    )
    app.state.serve = state
    errors.install(app)

    @app.get("/health", responses={503: ERRORS[503]})
    async def health():
        if state.draining:
            return errors.error_response(503, "shutting down", code="draining")
        status = {name: rt.state for name, rt in state.runtimes.items()}
        failed = {n: rt.error for n, rt in state.runtimes.items() if rt.state == "failed"}
        detail = "; ".join(f"{n}: {rt.error or rt.state}" for n, rt in state.runtimes.items() if rt.state != "ready")
        if state.fatal or (failed and len(failed) == len(status)):
            lost = not state.fatal and any(state.runtimes[n].kind is not None for n in failed)  # after loading
            what = "no model is serving" if lost else "no model could be loaded"
            return errors.error_response(503, f"{what}: {detail}", code="model_failed")
        if any(s == "loading" for s in status.values()):
            return errors.error_response(503, f"not ready: {detail}", code="loading", retry_after=2)
        pools = state.gateway.pools if state.gateway is not None else {}
        replicas = {n: {r.url: "up" if r.up else f"down: {r.why}" for r in p.replicas} for n, p in pools.items()}
        extra = {"replicas": replicas} if replicas else {}
        if failed:  # the others serve
            return {"status": "degraded", "models": status, "errors": failed, **extra}
        if any(all(not r.up for r in p.replicas) for p in pools.values()):  # a set with none up
            return {"status": "degraded", "models": status, **extra}
        return {"status": "ok", "models": status, **extra}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    models_api.install(app, state)  # GET /v1/models, /v1/models/{id}

    async def dispatch(endpoint: str, request: Request, req=None):
        # the body as sent: JSON, `model` (the one served, if none is named), `stream` checked
        req = req or models_api.read_body(state, await request.body(), endpoint)
        internal = req.raw.get("headwise") if isinstance(req, Incoming) else None
        if isinstance(internal, dict) and internal.get("resume") is not None:
            require_peer()  # before any target: a provider or replica would take it on our key
        known = req.model in config.model_names()
        try:
            resp = await state.gateway.dispatch(endpoint, req, request)
        except APIError as e:
            state.metrics.request(req.model if known else "unknown", endpoint, e.status)
            raise
        state.metrics.request(req.model, endpoint, resp.status_code)
        return resp

    twins = {}  # path -> the typed route /openapi.json shows for a raw one

    def raw_post(path: str, endpoint: str, **docs):
        def register(handler):
            twins[path] = documented(path, endpoint, handler.__name__, **docs)
            return app.post(path, include_in_schema=False)(handler)

        return register

    chat_docs = {"response_model": ChatCompletion, "responses": {**sse_docs(ChatCompletionChunk), **ERRORS}}

    @raw_post("/v1/chat/completions", "chat", **chat_docs)
    async def chat_completions(request: Request):
        return await dispatch("chat", request)

    messages_docs = {"response_model": MessageResponse, "responses": {**anthropic_api.STREAM, **anthropic_api.ERRORS}}

    @raw_post("/v1/messages", "messages", **messages_docs)
    async def create_message(request: Request):
        return await dispatch("messages", request)

    @raw_post(
        "/v1/messages/count_tokens",
        "count_tokens",
        response_model=anthropic_api.TokensCount,
        responses=anthropic_api.ERRORS,
    )
    async def count_message_tokens(request: Request):
        req = await read(request, "count_tokens")
        if "count_tokens" in getattr(state.gateway.targets.get(req.model), "endpoints", ()):  # api = "anthropic"
            return await dispatch("count_tokens", request, req)
        return JSONResponse(await anthropic_messages.count_tokens(state.runtimes, state.gateway, req.validated()))

    @raw_post("/v1/completions", "completions", response_model=Completion, responses={**sse_docs(Completion), **ERRORS})
    async def completions(request: Request):
        return await dispatch("completions", request)

    @raw_post("/v1/embeddings", "embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def create_embeddings(request: Request):
        return await dispatch("embeddings", request)

    responses_api.install(app, state)  # /v1/responses: translated to chat, through the same gateway

    def openapi() -> dict:
        """FastAPI's schema, plus the Bearer scheme on /v1 when keys are required (the auth
        middleware is invisible to FastAPI)."""
        if app.openapi_schema is None:
            routes = [twins.get(getattr(r, "path", None), r) for r in app.routes]  # typed twins in place
            schema = app.openapi_schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                description=app.description,
                routes=routes,
                separate_input_output_schemas=app.separate_input_output_schemas,
            )
            if config.server.keys():
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}
                }
                for path, ops in schema["paths"].items():
                    if path.startswith("/v1/") or (protect_metrics and path == "/metrics"):
                        for op in ops.values():
                            op["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi

    # outermost first to run: auth (cheap, before reading any body), then the body limit. Neither
    # touches a response's body: streamed chunks may bypass `send` (direct.py), so a middleware
    # that rewrites bodies (compression) would need DirectWriter off.
    app.add_middleware(BodySizeLimit, max_bytes=config.server.max_body_bytes)
    app.add_middleware(
        ApiKeyAuth,
        keys=config.server.keys(),
        protect_metrics=protect_metrics,
        accept_resume=config.server.accept_resume,
    )
    return app


def _version() -> str:
    from .. import __version__

    return __version__
