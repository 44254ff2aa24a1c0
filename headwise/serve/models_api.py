"""Which model a request means: GET /v1/models, GET /v1/models/{id} (openai's
client.models.retrieve), and the model a chat, completions or embeddings request gets when it
names none (as llama-server and vLLM serve one model without a name).

A request without `model` goes to the one model that can answer it: the one local decoder
(chat, completions) or encoder (embeddings) when nothing else is served; a model still loading
counts for both kinds, and a provider's or replica set's models for every kind, since what they
are is not known here. With more than one (or none), the 400 lists the names to choose from.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError
from .passthrough import Incoming, parse
from .schemas import ERRORS, ModelCard, ModelList

KINDS = {"chat": "generate", "completions": "generate", "embeddings": "embed"}  # endpoint -> local model kind


def card(state, name: str, owner: str) -> dict:
    entry = {"id": name, "object": "model", "created": state.started, "owned_by": owner}
    rt = state.runtimes.get(name)
    if rt is not None:  # local: loading | ready | failed (+ why)
        entry["status"] = rt.state
        if rt.state == "failed":
            entry["error"] = rt.error
        extra = rt.card()
        if extra is not None:  # an extension field: OpenAI clients keep it as an extra
            entry["headwise"] = extra
    return entry


def default_model(state, endpoint: str) -> str:
    """The one model that can answer `endpoint` -> its name; else a 400 naming the choices."""
    kind = KINDS[endpoint]
    local = [n for n, rt in state.runtimes.items() if rt.state != "failed" and rt.kind in (kind, None)]
    choices = local + state.config.remote_names()
    if len(choices) == 1:
        return choices[0]
    names = [n for n, _ in state.gateway.names()] if state.gateway is not None else []
    why = f"{len(choices)} models here could answer it" if choices else "no model here serves this endpoint"
    raise APIError(
        400,
        f'model: Field required ({why}); send "model" with one of: {", ".join(names) or "none"}',
        param="model",
        code="missing_model",
    )


def read_body(state, raw: bytes, endpoint: str) -> Incoming:
    """passthrough.parse, but a JSON object without `model` (or with null) gets the default model
    of its endpoint (chat, completions, embeddings); every other mistake keeps parse's error."""
    try:
        return parse(raw, endpoint)
    except Exception:
        if endpoint not in KINDS:
            raise
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict) or body.get("model") is not None:
            raise
    return parse(json.dumps({**body, "model": default_model(state, endpoint)}).encode(), endpoint)


def install(app: FastAPI, state) -> None:
    """GET /v1/models and /v1/models/{id}; `state` is app.py's ServeState."""

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def list_models():
        return JSONResponse({"object": "list", "data": [card(state, n, o) for n, o in state.gateway.names()]})

    # :path: "provider/model" and "replicas/model" ids hold a slash
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={401: ERRORS[401], 404: ERRORS[404]})
    async def retrieve_model(model_id: str):
        if not model_id:  # GET /v1/models/: the app's 404 for a path with a trailing slash
            raise StarletteHTTPException(404)
        for name, owner in state.gateway.names():
            if name == model_id:
                return JSONResponse(card(state, name, owner))
        raise APIError(
            404,
            f"The model {model_id!r} does not exist here; GET /v1/models lists the models served",
            param="model",
            code="model_not_found",
        )
