"""Generated text -> OpenAI's tool_calls, whole (a chat.completion's message) or as stream deltas.

The grammar (runtime/tool_grammar.py) wrote every call as `open + name + mid + ARGUMENTS + close`,
so reading them back is exact: the name runs to `mid`, the arguments are the one JSON object after
it (the text as generated, so streamed fragments join into the same string), `close` ends the call.
Text before the first call is the message's content; while streaming, a tail that could still grow
into `open` is held back until it either does or cannot.
"""

from __future__ import annotations

import json
import uuid

from ...runtime.tool_grammar import CallFormat

_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallParser:
    """Feed the text of one choice as it is generated; `feed` returns events:
    ("content", text), ("call", index, name), ("arguments", index, fragment)."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.buf = ""  # text not consumed yet
        self.state = "text"  # text | plain (text for good) | name | arguments | between (after a call)
        self.sent = 0  # characters of the current call's arguments already given out
        self.calls: list[list] = []  # [id, name, arguments text]
        self.content = ""

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        self.buf += text
        events: list[tuple] = []
        while self._step(events, final):
            pass
        return events

    def _step(self, events: list, final: bool) -> bool:
        """One move of the state machine; True when it consumed something and may move again."""
        f, buf = self.fmt, self.buf
        if self.state in ("text", "plain"):
            k = buf.find(f.open) if self.state == "text" else -1
            if k >= 0 and (f.anywhere or not self.content and not buf[:k]):
                self._content(events, buf[:k])
                self.buf, self.state = buf[k + len(f.open) :], "name"
                return True
            keep = 0 if final or self.state == "plain" else _open_prefix(buf, f.open)
            if not f.anywhere and (self.content or not f.open.startswith(buf[: len(f.open)])):
                self.state, keep = "plain", 0  # text that did not begin as a call stays text
            self._content(events, buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep :]
            return False
        if self.state == "name":
            k = buf.find(f.mid)
            if k < 0:
                return False
            self.calls.append([call_id(), buf[:k], ""])
            events.append(("call", len(self.calls) - 1, buf[:k]))
            self.buf, self.state, self.sent = buf[k + len(f.mid) :], "arguments", 0
            return True
        if self.state == "arguments":
            try:
                _, end = _DECODER.raw_decode(buf)
            except json.JSONDecodeError:
                end = None  # the object is not complete yet: all of it is arguments so far
            upto = len(buf) if end is None else end
            if upto > self.sent:
                events.append(("arguments", len(self.calls) - 1, buf[self.sent : upto]))
                self.sent = upto
            self.calls[-1][2] = buf[:upto]
            if end is not None and buf[end:].startswith(f.close):
                self.buf, self.state = buf[end + len(f.close) :], "between"
                return True
            return False
        # between calls: the separator and the next open, or the end
        nxt = f.sep + f.open
        if buf.startswith(nxt):
            self.buf, self.state = buf[len(nxt) :], "name"
            return True
        if buf and (final or not nxt.startswith(buf)):  # not the grammar's text: keep it as content
            self._content(events, buf)
            self.buf, self.state = "", "plain"
        return False

    def _content(self, events: list, text: str) -> None:
        if text:
            self.content += text
            events.append(("content", text))

    def message(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """-> (the assistant message, finish reason) once all text was fed (final=True)."""
        if not self.calls:
            return {"role": "assistant", "content": self.content}, finish_reason
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self.calls]
        content = self.content if self.content.strip() else None
        return {"role": "assistant", "content": content, "tool_calls": calls}, _reason(finish_reason)


def _reason(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _open_prefix(text: str, open_: str) -> int:
    """Length of the longest tail of text that begins open_ (it may yet become a call)."""
    for n in range(min(len(text), len(open_)), 0, -1):
        if open_.startswith(text[-n:]):
            return n
    return 0


def delta_chunks(parser: CallParser, text: str, finish_reason: str | None) -> list[tuple[dict, str | None]]:
    """A piece of a streamed choice -> (delta, finish_reason) pairs, one chunk each, in OpenAI's
    shape: a call's first delta has index, id, type, function.name and arguments "", later ones
    carry arguments fragments; the finish reason ("tool_calls" after calls) rides on the last."""
    out: list[tuple[dict, str | None]] = []
    for ev in parser.feed(text, final=finish_reason is not None):
        if ev[0] == "content":
            if out and "content" in out[-1][0]:
                out[-1][0]["content"] += ev[1]
            else:
                out.append(({"content": ev[1]}, None))
        elif ev[0] == "call":
            cid = parser.calls[ev[1]][0]
            fn = {"name": ev[2], "arguments": ""}
            out.append(({"tool_calls": [{"index": ev[1], "id": cid, "type": "function", "function": fn}]}, None))
        else:
            out.append(({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}, None))
    if finish_reason is not None:
        reason = _reason(finish_reason) if parser.calls else finish_reason
        if out:
            out[-1] = (out[-1][0], reason)
        else:
            out.append(({}, reason))
    return out
