"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is translated into a chat completion request (response_request.py) and
sent through the gateway as /v1/chat/completions is, so whatever serves chat serves this too: a
local model (its chat template, tool format and grammar, the engine), an upstream provider (it
receives an ordinary /chat/completions request), a route, a replica set. Chat's answer is
translated back (response_output.py): a `message` item and `function_call` items, or,
streamed, the events openai-python's `client.responses.stream` reads.

    previous_response_id -> that response's messages and answer (its calls too) before this input
    store: true          -> kept in a bounded in-memory store (response_store.py)

Not served (a 400 naming the field): built-in tools, reasoning, background, top_logprobs,
images and files in the input.
"""

from __future__ import annotations

import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..direct import SCOPE_KEY
from ..errors import APIError
from ..schemas import ERRORS, ChatCompletionRequest
from .response_output import assistant_message, events, new_id, output_items, response_object, usage
from .response_request import ResponsesRequest, chat_request
from .response_store import ResponseStore
from .streams import EventStream

__all__ = ["ResponsesRequest", "chat_request", "install"]


# ---------------------------------------------------------------- the routes
_STREAMED = {  # the 200 of POST /v1/responses: JSON, or with stream: true these events
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": "stream=true: `event: <type>` / `data: {type, sequence_number, ...}` events, "
                    "from response.created to response.completed (or response.incomplete, or an error event)",
                }
            }
        }
    }
}


def install(app: FastAPI, state) -> ResponseStore:
    """Add the routes to the app; `state` is app.py's ServeState (its gateway, metrics)."""
    store = ResponseStore.from_env()
    app.state.responses_store = store

    async def dispatch(req: ResponsesRequest, chat: ChatCompletionRequest, request: Request):
        known = req.model in state.config.model_names()
        # a copy of the request without the connection's transport: chat must not write its chunks
        # to the socket itself (serve/direct.py), they are translated here
        scope = {**request.scope, "extensions": {**(request.scope.get("extensions") or {}), SCOPE_KEY: None}}
        try:
            resp = await state.gateway.dispatch("chat", chat, Request(scope, request.receive))
        except APIError as e:
            state.metrics.request(req.model if known else "unknown", "responses", e.status)
            # chat's field names -> ours (context_length_exceeded names messages / max_tokens)
            e.param = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}.get(
                e.param, e.param
            )
            raise
        state.metrics.request(req.model, "responses", resp.status_code)
        return resp

    @app.post("/v1/responses", responses={**_STREAMED, **ERRORS})
    async def create_response(req: ResponsesRequest, request: Request):
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise APIError(
                    404,
                    f"Previous response with id {req.previous_response_id!r} not found (headwise keeps only "
                    f"responses created with store: true, at most {store.max_items} for {store.max_age:g} s)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                    type="invalid_request_error",
                )
            history = prev.messages
        chat, messages = chat_request(req, history)
        rid, created = new_id("resp"), int(time.time())
        resp = await dispatch(req, chat, request)
        target = {"x-headwise-target": resp.headers["x-headwise-target"]} if "x-headwise-target" in resp.headers else {}

        def keep(obj: dict) -> None:
            if req.store:
                store.put(rid, obj, messages + [assistant_message(obj["output"])])

        if not req.stream:
            answer = json.loads(resp.body)
            output, status = output_items(req, answer)
            obj = response_object(req, rid, created, status, output, usage(answer.get("usage")))
            keep(obj)
            return JSONResponse(obj, headers=target)
        return EventStream(events(req, resp.body_iterator, rid, created, keep), request, headers=target)

    @app.get("/v1/responses/{response_id}", responses=ERRORS)
    async def get_response(response_id: str):
        item = store.get(response_id)
        if item is None:
            raise APIError(404, f"No response with id {response_id!r} is stored here", code="response_not_found")
        return JSONResponse(item.response)

    @app.delete("/v1/responses/{response_id}", responses=ERRORS)
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise APIError(404, f"No response with id {response_id!r} is stored here", code="response_not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return store
