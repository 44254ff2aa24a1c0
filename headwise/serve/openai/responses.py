"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is translated into a chat completion request and sent through the
gateway as /v1/chat/completions is, so whatever serves chat serves this too: a local
model (its chat template, the engine), an upstream provider (it receives an ordinary
/chat/completions request), a route, a replica set. Chat's answer is translated back:
one `message` output item with one `output_text` part, or, streamed, the events
openai-python's `client.responses.stream` reads (response.created ... response.completed,
each with its sequence_number).

    input (a string, or messages with input_text / output_text parts) -> messages
    instructions -> a system message first (not carried over by previous_response_id, as OpenAI)
    previous_response_id -> that response's messages and answer before this input (store.py)
    max_output_tokens -> max_tokens; finish_reason "length" -> status "incomplete"
    text.format -> response_format (json_schema / json_object: what chat serves)

Not served yet (a 400 naming the field): tools, a tool_choice other than none/auto,
reasoning, background, top_logprobs, images and files in the input.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from ..direct import SCOPE_KEY
from ..errors import APIError
from ..schemas import ERRORS, ChatCompletionRequest, NonEmpty, Strict
from .response_store import ResponseStore


# ---------------------------------------------------------------- request
class InputPart(Strict):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn sent back as input
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


class InputMessage(Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class TextConfig(Strict):
    format: Optional[dict] = None  # {"type": "text"} | {"type": "json_schema", "name", "schema", "strict"}
    verbosity: Optional[str] = None


class ResponsesRequest(Strict):
    model: NonEmpty
    input: Union[str, Annotated[list[InputMessage], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None  # headwise: false unless set (OpenAI: true)
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[dict]] = None  # only [] is served
    tool_choice: Optional[Union[str, dict]] = None  # only none / auto
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    reasoning: Optional[dict] = None  # only null / {}
    background: Optional[bool] = None  # only false
    top_logprobs: Optional[int] = None  # only 0
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[dict] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None


def _unsupported(req: ResponsesRequest) -> None:
    checks = {
        "tools": (not req.tools, "function tools are not supported yet on /v1/responses"),
        "tool_choice": (
            req.tool_choice in (None, "none", "auto"),
            "tool_choice needs tools, which are not supported yet on /v1/responses",
        ),
        "reasoning": (not req.reasoning, "reasoning options are not supported: headwise's models do not reason"),
        "background": (not req.background, "background responses are not supported; stream instead"),
        "top_logprobs": (not req.top_logprobs, "top_logprobs is not supported yet on /v1/responses"),
    }
    for param, (ok, message) in checks.items():
        if not ok:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":  # the Responses API puts name / schema / strict beside the type
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, f"text.format type {kind!r} is not one of text, json_schema, json_object", param="text.format")


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """-> (the chat request to send, this turn's messages: history + input, for the store)."""
    if isinstance(req.input, str):
        turn = [{"role": "user", "content": req.input}]
    else:
        turn = [{"role": m.role, "content": _text(m.content)} for m in req.input]
    messages = history + turn
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict = {"model": req.model, "messages": system + messages, "stream": bool(req.stream)}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    if req.user is not None:
        body["user"] = req.user
    try:
        return ChatCompletionRequest.model_validate(body), messages
    except ValidationError as e:  # chat's schema refuses what ours let through: the client's request still
        raise APIError(400, f"the request cannot be served as a chat completion: {e.errors()[0]['msg']}") from None


# ---------------------------------------------------------------- response objects
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(mid: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": [part]}


def _usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    i, o = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    return {
        "input_tokens": i,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": o,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": i + o,
    }


def response_object(req: ResponsesRequest, rid: str, created: int, status: str, output: list, usage=None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "store": bool(req.store),
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in (None, "length") else "completed"


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
        _unsupported(req)
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
        rid, mid, created = _new_id("resp"), _new_id("msg"), int(time.time())
        resp = await dispatch(req, chat, request)
        target = {"x-headwise-target": resp.headers["x-headwise-target"]} if "x-headwise-target" in resp.headers else {}

        def keep(obj: dict, text: str) -> None:
            if req.store:
                store.put(rid, obj, messages + [{"role": "assistant", "content": text}])

        if not req.stream:
            answer = json.loads(resp.body)
            choice = answer["choices"][0]
            text, status = choice["message"].get("content") or "", _status(choice.get("finish_reason"))
            obj = response_object(req, rid, created, status, [_message(mid, text, status)], _usage(answer.get("usage")))
            keep(obj, text)
            return JSONResponse(obj, headers=target)
        events = _events(req, resp.body_iterator, rid, mid, created, keep)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **target},
        )

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


# ---------------------------------------------------------------- streaming
async def _chunks(body):
    """Chat's SSE bytes -> its JSON objects; None for data: [DONE]."""
    buf = b""
    async for piece in body:
        buf += piece.encode() if isinstance(piece, str) else piece
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            data = b"\n".join(line[5:].strip() for line in raw.splitlines() if line.startswith(b"data:"))
            if not data:
                continue
            yield None if data == b"[DONE]" else json.loads(data)


async def _events(req: ResponsesRequest, body, rid: str, mid: str, created: int, keep):
    seq = 0

    def event(kind: str, **fields) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    where = {"item_id": mid, "output_index": 0, "content_index": 0}
    text, finish, usage = "", None, None
    try:
        empty = response_object(req, rid, created, "in_progress", [])
        yield event("response.created", response=empty)
        yield event("response.in_progress", response=empty)
        item = _message(mid, "", "in_progress")
        yield event("response.output_item.added", output_index=0, item={**item, "content": []})
        yield event("response.content_part.added", **where, part=item["content"][0])
        async for chunk in _chunks(body):
            if chunk is None:
                break
            if "error" in chunk:  # an error after the start: OpenAI's error event, then the end
                err = chunk["error"]
                yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text += piece
                    yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
                finish = choice.get("finish_reason") or finish
    finally:
        if hasattr(body, "aclose"):
            await body.aclose()  # a client that left: chat's stream aborts its engine request
    status = _status(finish)
    done = _message(mid, text, status)
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where, part=done["content"][0])
    yield event("response.output_item.done", output_index=0, item=done)
    final = response_object(req, rid, created, status, [done], _usage(usage))
    keep(final, text)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
