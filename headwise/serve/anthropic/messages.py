"""POST /v1/messages on a local model: the Anthropic request becomes the chat request that
/v1/chat/completions serves (translate.py; the same chat template, tokenizer, context check and
sampling: openai/chat.py's `prepare`), runs on the same engine streams, and comes back as an
Anthropic message or as its SSE events:

    message_start, content_block_start, ping, content_block_delta (text_delta)...,
    content_block_stop, message_delta (stop_reason, usage), message_stop

An error after the stream began travels as `event: error` in Anthropic's envelope.
stop_reason: "max_tokens" (the limit), "end_turn" (the model's own end-of-turn / EOS id) or
"stop_sequence" (one of stop_sequences, named in `stop_sequence`). A last assistant message is
a prefill: the answer continues it and leaves it out, as Anthropic's does.

A request with tools goes through the local chat path whole (chat.create: the template's tool
format, the constrained calls) and is translated back as an upstream's answer is (via_chat.py):
stop_reason "tool_use", tool_use blocks, input_json_delta events. A prefill with tools is a 400.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from ..direct import SCOPE_KEY
from ..errors import APIError
from ..openai import chat
from ..openai.common import body_size, check_chars, check_context, off_loop, tokenize
from ..openai.streams import ABORTED, EventStream, Streams, fair_share, stream_error, until_disconnect
from ..schemas import ChatCompletionRequest
from . import envelope, via_chat
from .schemas import CountTokensRequest, MessagesRequest
from .translate import event, message, to_chat


def _prepare(runtime, chat_req: ChatCompletionRequest, prefill: str):
    """Off the loop: the chat template (chat.prepare), then the prefill's ids after it."""
    prompt, sampling, _ = chat.prepare(runtime, chat_req)
    if prefill:
        prompt = prompt + tokenize(runtime.tokenizer, prefill, special=False)
        check_context([len(prompt)], sampling.max_new_tokens, runtime.max_model_len, "messages")
    return prompt, sampling


def stop_reason(tok, sampling, reason: str | None, text: str, ids: list[int]) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence). The engine says "stop" for an end-of-turn id and for a
    stop string alike: the last id tells them apart. The text was cut where the stop string
    began, so the stop that ended it is the one the full decode has there."""
    from ...runtime.output import stop_ids

    if reason == "abort":
        raise APIError(503, ABORTED, code="aborted")
    if reason != "stop":
        return "max_tokens", None
    if not sampling.stop or (ids and ids[-1] in stop_ids(tok, sampling)):
        return "end_turn", None
    full = tok.decode(ids)
    here = [s for s in sampling.stop if full.startswith(s, len(text))]
    if here:
        return "stop_sequence", min(here, key=len)  # of two that start here, the shorter ended first
    found = [(full.find(s), s) for s in sampling.stop if s in full]
    return "stop_sequence", min(found)[1] if found else sampling.stop[0]


async def _with_tools(runtime, req, chat_req, model: str, request: Request, timeout, metrics):
    """A request with tools: the local chat path serves it (the template's tool format, the grammar
    of the calls, chat's parsing of them), and its answer is translated as an upstream's is."""
    # chat must not write its chunks to the socket itself (serve/direct.py): they are translated here
    scope = {**request.scope, "extensions": {**(request.scope.get("extensions") or {}), SCOPE_KEY: None}}
    resp = await chat.create(
        runtime, chat_req, model, Request(scope, request.receive), timeout=timeout, metrics=metrics
    )
    return via_chat.respond(req, resp, model, request)


async def create(runtime, req: MessagesRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("generate", "/v1/messages")
    chat_req, prefill = to_chat(req)
    if chat_req.tools:
        if prefill:
            raise APIError(
                400,
                "a last assistant turn (prefill) cannot be continued with tools: end with a user turn",
                param="messages",
            )
        return await _with_tools(runtime, req, chat_req, model, request, timeout, metrics)
    check_chars([*chat.message_texts(chat_req), prefill], runtime.spec.max_input_chars, "messages")
    prompt, sampling = await off_loop(_prepare, runtime, chat_req, prefill, size=body_size(request))
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    streams = Streams(runtime, rid, 1, fair_share(request))
    await streams.start([prompt], sampling, timeout)  # errors until the first piece are HTTP errors
    run = _Run(streams, rid, model, len(prompt), runtime.tokenizer, sampling, metrics)
    if req.stream:
        return EventStream(run.events(), request)
    return JSONResponse(await until_disconnect(run.collect(), request))


class _Run:
    """One request's engine stream, read to its end as one message or as SSE events."""

    def __init__(self, streams, rid, model, input_tokens, tok, sampling, metrics):
        self.streams, self.rid, self.model, self.input_tokens = streams, rid, model, input_tokens
        self.tok, self.sampling, self.metrics = tok, sampling, metrics
        self.text, self.ids, self.reason, self.output_tokens = "", [], None, 0

    def _take(self, piece) -> str:
        if self.metrics:
            self.metrics.token_piece(self.model, self.streams, piece)
        self.ids += piece.token_ids
        self.output_tokens = piece.num_output_tokens
        self.reason = piece.finish_reason or self.reason
        if piece.finish_reason == "abort":
            raise APIError(503, ABORTED, code="aborted")
        self.text += piece.text
        return piece.text

    def _finish(self) -> tuple[str, str | None]:
        if self.metrics:
            self.metrics.finished(self.model, self.streams)
        return stop_reason(self.tok, self.sampling, self.reason, self.text, self.ids)

    async def collect(self) -> dict:
        try:
            async for _, piece in self.streams:
                self._take(piece)
        finally:
            await self.streams.close()
        reason, sequence = self._finish()
        return message(self.rid, self.model, self.text, reason, sequence, self.input_tokens, self.output_tokens)

    async def events(self):
        try:
            start = message(self.rid, self.model, None, None, None, self.input_tokens, 0)
            yield event("message_start", {"type": "message_start", "message": start})
            block = {"type": "text", "text": ""}
            yield event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
            yield event("ping", {"type": "ping"})
            async for _, piece in self.streams:
                text = self._take(piece)
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
            reason, sequence = self._finish()
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
            usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            yield event("message_stop", {"type": "message_stop"})
        except Exception as e:
            err = stream_error(e)
            yield event("error", envelope.body(err.status, err.message))
        finally:
            await self.streams.close()


async def count_tokens(runtimes: dict, gateway, req: CountTokensRequest) -> dict:
    """POST /v1/messages/count_tokens on a local model: the ids the same request would prefill,
    counted (chat's template and tokenizer, the prefill after it)."""
    runtime = runtimes.get(req.model)
    if runtime is None:
        gateway.route(req.model)  # an unknown name: its 404
        raise APIError(
            400,
            f"count_tokens is served for headwise's local models; {req.model!r} is a route or an upstream target",
            param="model",
        )
    runtime.require("generate", "/v1/messages/count_tokens")
    full = MessagesRequest.model_validate({**req.model_dump(exclude_unset=True), "max_tokens": 1})
    chat_req, prefill = to_chat(full)
    check_chars([*chat.message_texts(chat_req), prefill], runtime.spec.max_input_chars, "messages")

    def count() -> int:
        prompt = chat.render_prompt(runtime.tokenizer, chat_req)
        return len(prompt) + (len(tokenize(runtime.tokenizer, prefill, special=False)) if prefill else 0)

    return {"input_tokens": await off_loop(count)}
