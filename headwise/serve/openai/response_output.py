"""Chat's answer as a Responses API response: output items, the response object, and the SSE
events openai-python's `client.responses.stream` reads.

    chat message content            -> a `message` item, one `output_text` part
    chat message tool_calls         -> `function_call` items (id "fc_...", call_id = the call's id)
    finish_reason "length"          -> status "incomplete" (incomplete_details: max_output_tokens)

Streamed, each item opens when its first piece arrives and closes when the next item opens or
the answer ends:

    response.created, response.in_progress
    message:        output_item.added, content_part.added, output_text.delta...,
                    output_text.done, content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta...,
                    function_call_arguments.done, output_item.done
    response.completed | response.incomplete   (or an `error` event)

every event with its sequence_number.
"""

from __future__ import annotations

import json
import uuid

from .response_request import ResponsesRequest, echo_tools


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(mid: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": [part]}


def call_item(fid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": fid,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(chat_usage: dict | None) -> dict | None:
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


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in (None, "length") else "completed"


def response_object(req: ResponsesRequest, rid: str, created: int, status: str, output: list, used=None) -> dict:
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
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "store": bool(req.store),
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": echo_tools(req),
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": used,
        "user": req.user,
    }


def assistant_message(output: list[dict]) -> dict:
    """The answer's items as the chat message the store keeps (previous_response_id replays it)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in output
        if c["type"] == "function_call" and c["status"] != "incomplete"  # a call cut short: not replayed
    ]
    return (
        {"role": "assistant", "content": text or None, "tool_calls": calls}
        if calls
        else {"role": "assistant", "content": text}
    )


def output_items(req: ResponsesRequest, answer: dict) -> tuple[list[dict], str]:
    """A chat completion (JSON) -> (output items, status)."""
    choice = answer["choices"][0]
    msg = choice.get("message") or {}
    status = status_of(choice.get("finish_reason"))
    text = msg.get("content") or ""
    calls = (msg.get("tool_calls") or [])[: req.max_tool_calls]
    items = [message_item(new_id("msg"), text, status)] if text or not calls else []
    for k, c in enumerate(calls):
        fn = c.get("function") or {}
        cut = status == "incomplete" and k == len(calls) - 1  # max_output_tokens ended the last call
        call_id, args = c.get("id") or new_id("call"), fn.get("arguments") or ""
        items.append(call_item(new_id("fc"), call_id, fn.get("name", ""), args, "incomplete" if cut else "completed"))
    return items, status


# ---------------------------------------------------------------- streaming
async def chat_chunks(body):
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


class _Stream:
    """The items of one streamed answer, as they open and close."""

    def __init__(self, req: ResponsesRequest):
        self.req, self.seq = req, 0
        self.items: list[dict] = []  # closed items, in output order
        self.open: dict | None = None  # the item receiving pieces
        self.calls: dict[int, dict] = {}  # chat's tool_calls index -> its item
        self.text = ""

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    def close(self, status: str):
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items)
        if item["type"] == "message":
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = message_item(item["id"], self.text, status)
            yield self.event("response.output_text.done", **where, text=self.text, logprobs=[])
            yield self.event("response.content_part.done", **where, part=done["content"][0])
        else:
            done = {**item, "status": status}
            where = {"item_id": item["id"], "output_index": index}
            yield self.event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
            )
        self.items.append(done)
        yield self.event("response.output_item.done", output_index=index, item=done)

    def open_message(self):
        yield from self.close("completed")
        self.open, self.text = message_item(new_id("msg"), "", "in_progress"), ""
        index = len(self.items)
        yield self.event("response.output_item.added", output_index=index, item={**self.open, "content": []})
        where = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
        yield self.event("response.content_part.added", **where, part=self.open["content"][0])

    def text_piece(self, piece: str):
        if self.open is None or self.open["type"] != "message":
            yield from self.open_message()
        self.text += piece
        where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        yield self.event("response.output_text.delta", **where, delta=piece, logprobs=[])

    def call_piece(self, delta: dict):
        k = delta.get("index", 0)
        fn = delta.get("function") or {}
        item = self.calls.get(k)
        if item is None:
            if self.req.max_tool_calls is not None and len(self.calls) >= self.req.max_tool_calls:
                return  # past max_tool_calls: dropped
            yield from self.close("completed")
            item = call_item(new_id("fc"), delta.get("id") or new_id("call"), fn.get("name") or "", "", "in_progress")
            self.calls[k] = self.open = item
            yield self.event("response.output_item.added", output_index=len(self.items), item=item)
        elif fn.get("name"):
            item["name"] += fn["name"]  # a name in pieces (OpenAI sends it whole, with the id)
        if item is not self.open:
            return  # a piece of a call already closed: OpenAI's chat streams calls one after another
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            where = {"item_id": item["id"], "output_index": len(self.items)}
            yield self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"])


async def events(req: ResponsesRequest, body, rid: str, created: int, keep):
    """Chat's SSE body -> the Responses API's events; keep(final response) stores it."""
    s, finish, used = _Stream(req), None, None
    try:
        empty = response_object(req, rid, created, "in_progress", [])
        yield s.event("response.created", response=empty)
        yield s.event("response.in_progress", response=empty)
        async for chunk in chat_chunks(body):
            if chunk is None:
                break
            if "error" in chunk:  # an error after the start: OpenAI's error event, then the end
                err = chunk["error"]
                yield s.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                return
            used = chunk.get("usage") or used
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for e in s.text_piece(delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or ():
                    for e in s.call_piece(call):
                        yield e
                finish = choice.get("finish_reason") or finish
    finally:
        if hasattr(body, "aclose"):
            await body.aclose()  # a client that left: chat's stream aborts its engine request
    status = status_of(finish)
    if s.open is None and not s.items:  # an empty answer is still one (empty) message
        for e in s.open_message():
            yield e
    for e in s.close(status):
        yield e
    final = response_object(req, rid, created, status, s.items, usage(used))
    keep(final)
    yield s.event("response.completed" if status == "completed" else "response.incomplete", response=final)
