"""/v1/messages answered by OpenAI's chat: an OpenAI-style target (an upstream provider, a replica
set) gets the chat request (translate.to_chat), and chat's answer comes back as an Anthropic
message, or chat's SSE chunks as Anthropic's events. messages.py serves a local model's tool
requests this way too, through the local chat path.

    message.content                 -> a text block (left out when the answer only calls tools)
    message.tool_calls              -> tool_use blocks {id: "toolu_...", name, input: the arguments parsed}
    finish_reason tool_calls        -> stop_reason "tool_use"; length -> "max_tokens"; stop -> "end_turn"

Streamed, a block opens when its first piece arrives (content_block_start; a tool_use block with
input {}), its pieces follow as text_delta or input_json_delta (partial_json: chat's argument
fragments as they come), and it stops when the next opens or the answer ends; ping follows the
first block's start, as Anthropic sends it.

What an OpenAI answer cannot say: which stop sequence ended it. finish_reason "stop" is
"stop_sequence" only where the upstream names the string (vLLM's `stop_reason`), else
"end_turn". A prefill (a last assistant turn) has no chat equivalent: a 400 here.
"""

from __future__ import annotations

import json
import uuid

from fastapi.responses import JSONResponse

from ..errors import APIError
from ..openai.streams import EventStream
from . import envelope
from .schemas import MessagesRequest
from .translate import event, max_tool_uses, message, to_chat, tool_use_id


def _stop(req: MessagesRequest, choice: dict) -> tuple[str, str | None]:
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    named = choice.get("stop_reason")  # vLLM: the stop string that matched (an int: a stop token id)
    if isinstance(named, str) and named in (req.stop_sequences or ()):
        return "stop_sequence", named
    return "end_turn", None


def _tokens(usage: dict | None) -> tuple[int, int]:
    usage = usage or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _input(name: str, arguments: str) -> dict:
    """A call's arguments (JSON text) -> tool_use's input object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(
            502, f"the model's call of tool {name!r} has arguments that are not a JSON object: {arguments[:200]!r}"
        )
    return value


def _parses(arguments) -> bool:
    try:
        return isinstance(json.loads(arguments or "{}"), dict)
    except ValueError:
        return False


def answer_message(req: MessagesRequest, answer: dict, rid: str, model: str) -> dict:
    """A chat completion (JSON) -> an Anthropic message."""
    choice = answer["choices"][0]
    msg = choice.get("message") or {}
    calls = (msg.get("tool_calls") or [])[: max_tool_uses(req)]
    text = msg.get("content") or ""
    blocks = [{"type": "text", "text": text}] if text else []
    reason, sequence = _stop(req, choice)
    for k, c in enumerate(calls):
        fn = c.get("function") or {}
        name, arguments = fn.get("name") or "", fn.get("arguments")
        if reason == "max_tokens" and k == len(calls) - 1 and not _parses(arguments):
            break  # the call max_tokens cut short: its input is not all there
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": name, "input": _input(name, arguments)})
    blocks = blocks or [{"type": "text", "text": ""}]  # no text and no whole call: one empty text block
    return message(rid, model, blocks, reason, sequence, *_tokens(answer.get("usage")))


def respond(req: MessagesRequest, resp, model: str, request):
    """Chat's response (JSON, or a stream of chunks) -> Anthropic's; a stream's client that reads
    nothing is cut off as a chat stream's is ([server] stall_timeout)."""
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    if not req.stream:
        return JSONResponse(answer_message(req, json.loads(resp.body), rid, model))
    return EventStream(_events(req, resp.body_iterator, rid, model), request)


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
        resp = await self.target.handle("chat", chat_req, chat_body, request, model, timeout, metrics, settle)
        return respond(req, resp, model, request)


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


class _Blocks:
    """The content blocks of one streamed answer, as they open and stop."""

    def __init__(self, limit: int | None):
        self.index, self.kind = -1, None  # the open block: its index and type (None: none open)
        self.calls: dict[int, int] = {}  # chat's tool_calls index -> block index
        self.limit = limit

    def open(self, block: dict):
        yield from self.stop()
        self.index += 1
        self.kind = block["type"]
        yield event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        if self.index == 0:
            yield event("ping", {"type": "ping"})

    def stop(self):
        if self.kind is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.kind = None

    def _delta(self, delta: dict):
        yield event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, text: str):
        if self.kind != "text":
            yield from self.open({"type": "text", "text": ""})
        yield from self._delta({"type": "text_delta", "text": text})

    def call(self, delta: dict):
        k, fn = delta.get("index", 0), delta.get("function") or {}
        if k not in self.calls:
            if self.limit is not None and len(self.calls) >= self.limit:
                return  # disable_parallel_tool_use: the first call only
            yield from self.open({"type": "tool_use", "id": tool_use_id(), "name": fn.get("name") or "", "input": {}})
            self.calls[k] = self.index
        if self.calls[k] == self.index and self.kind == "tool_use" and fn.get("arguments"):
            yield from self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})


async def _events(req: MessagesRequest, body, rid: str, model: str):
    choice, usage, blocks = {}, None, _Blocks(max_tool_uses(req))
    try:
        start = message(rid, model, None, None, None, 0, 0)
        yield event("message_start", {"type": "message_start", "message": start})
        async for chunk in _chunks(body):
            if "error" in chunk:  # the upstream's error after the start (already our own words: upstream.py)
                err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                yield event("error", envelope.body(500, str(err.get("message") or "the upstream failed")))
                return
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or ():
                delta = c.get("delta") or {}
                if delta.get("content"):
                    for e in blocks.text(delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or ():
                    for e in blocks.call(call):
                        yield e
                if c.get("finish_reason"):
                    choice = c
        if blocks.index < 0:  # an empty answer: one empty text block, as Anthropic sends it
            for e in blocks.open({"type": "text", "text": ""}):
                yield e
        for e in blocks.stop():
            yield e
        reason, sequence = _stop(req, choice)
        input_tokens, output_tokens = _tokens(usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage_out = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_out})
        yield event("message_stop", {"type": "message_stop"})
    except ValueError:  # a chunk that is not JSON: upstream.py checks them, so a relay bug
        yield event("error", envelope.body(500, "the upstream's stream could not be read"))
    finally:
        if hasattr(body, "aclose"):
            await body.aclose()  # a client that left: the upstream stream closes too
