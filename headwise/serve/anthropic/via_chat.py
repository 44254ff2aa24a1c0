"""/v1/messages on an OpenAI-style target (an upstream provider, a replica set): the request goes
out as the chat request a local model would serve (messages.to_chat), and chat's answer comes
back as an Anthropic message, or chat's SSE chunks as Anthropic's events.

What an OpenAI answer cannot say: which stop sequence ended it. finish_reason "stop" is
"stop_sequence" only where the upstream names the string (vLLM's `stop_reason`), else
"end_turn". A prefill (a last assistant turn) has no chat equivalent: a 400 here.
"""

from __future__ import annotations

import json
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import APIError
from . import envelope
from .messages import event, message, to_chat
from .schemas import MessagesRequest


def _stop(req: MessagesRequest, choice: dict) -> tuple[str, str | None]:
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    named = choice.get("stop_reason")  # vLLM: the stop string that matched (an int: a stop token id)
    if isinstance(named, str) and named in (req.stop_sequences or ()):
        return "stop_sequence", named
    return "end_turn", None


def _tokens(usage: dict | None) -> tuple[int, int]:
    usage = usage or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def _chunks(body):
    """Chat's SSE bytes (upstream.py frames every event as `data: ...` + a blank line) -> its JSON
    objects, until data: [DONE]."""
    buf = b""
    async for piece in body:
        buf += piece.encode() if isinstance(piece, str) else piece
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            data = b"\n".join(line[5:].strip() for line in raw.splitlines() if line.startswith(b"data:"))
            if data == b"[DONE]":
                return
            if data:
                yield json.loads(data)


class ViaChat:
    """Wraps a gateway target that speaks only OpenAI's chat: same `handle` as the gateway calls."""

    def __init__(self, target):
        self.target = target
        self.settles_streams = getattr(target, "settles_streams", False)

    async def handle(self, endpoint, req: MessagesRequest, body, request, model, timeout, metrics, settle=None):
        chat_req, prefill = to_chat(req)
        if prefill:
            raise APIError(
                400,
                "a last assistant turn (prefill) is served only by headwise's local models: "
                f"{self.target.name!r} answers OpenAI chat requests, which cannot continue a turn",
                param="messages",
            )
        chat_body = chat_req.model_dump(mode="json", exclude_unset=True)
        if req.stream:
            chat_body["stream_options"] = {"include_usage": True}  # the usage message_delta reports
        resp = await self.target.handle("chat", chat_req, chat_body, request, model, timeout, metrics, settle)
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        if not req.stream:
            answer = json.loads(resp.body)
            choice = answer["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
            reason, sequence = _stop(req, choice)
            return JSONResponse(message(rid, model, text, reason, sequence, *_tokens(answer.get("usage"))))
        return StreamingResponse(
            _events(req, resp.body_iterator, rid, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _events(req: MessagesRequest, body, rid: str, model: str):
    choice, usage = {}, None
    try:
        start = message(rid, model, None, None, None, 0, 0)
        yield event("message_start", {"type": "message_start", "message": start})
        block = {"type": "text", "text": ""}
        yield event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
        yield event("ping", {"type": "ping"})
        async for chunk in _chunks(body):
            if "error" in chunk:  # the upstream's error after the start (already our own words: upstream.py)
                err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                yield event("error", envelope.body(500, str(err.get("message") or "the upstream failed")))
                return
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or ():
                text = (c.get("delta") or {}).get("content")
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
                if c.get("finish_reason"):
                    choice = c
        reason, sequence = _stop(req, choice)
        input_tokens, output_tokens = _tokens(usage)
        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage_out = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_out})
        yield event("message_stop", {"type": "message_stop"})
    except ValueError:  # a chunk that is not JSON: upstream.py checks them, so a relay bug
        yield event("error", envelope.body(500, "the upstream's stream could not be read"))
    finally:
        if hasattr(body, "aclose"):
            await body.aclose()  # a client that left: the upstream stream closes too
