"""An upstream that speaks Anthropic's Messages API ([providers.NAME] api = "anthropic"): /v1/messages
passed straight through, as upstream.py passes OpenAI's endpoints.

    POST <base_url>/messages        base_url as for OpenAI providers: up to /v1 ("https://api.anthropic.com/v1")
    x-api-key: <the configured key> the client's own key never goes out
    anthropic-version               the client's, else [providers.NAME] anthropic_version (2023-06-01)
    anthropic-beta                  the client's, when it sent one (betas enable the fields it sends)
    body                            as the client sent it, `model` renamed
    /v1/messages/count_tokens       the same, to <base_url>/messages/count_tokens

A 200 must be a JSON object of type "message" with a `content` list; a stream, SSE events that each
have an `event:` line and a JSON object as data, starting with message_start and ending with
message_stop. Its error answers become our own messages in Anthropic's envelope (upstream.py's
rules: its text is never relayed, it may echo the key); a fault after the first byte ends the
stream with an `event: error`. Chat, completions and embeddings are not translated to Messages:
the gateway answers them with a 400 naming the mismatch.
"""

from __future__ import annotations

import json
import re

from fastapi import Request

from .anthropic import envelope
from .errors import APIError
from .upstream import _LINE, KEEPALIVE, Events, Fault, UpstreamTarget, plain_fields
from .upstream_body import REDACTED, parsed, scrubbed

_VERSION = re.compile(r"[A-Za-z0-9._, \-]{1,256}")  # 2023-06-01; betas: "a-2025-01-01,b-2025-02-02"


class MessagesEvents(Events):
    """Anthropic's SSE events, checked: `event: NAME` + a JSON data line, framed anew; pings and
    comments pass as they are; `event: error` is a Fault; message_stop ends the stream."""

    END = "event: message_stop"

    def __init__(self, chunks, secret: str | None):
        super().__init__(chunks, secret)
        self.started = False

    def _check(self, raw: bytes) -> bytes:
        lines = _LINE.split(raw)
        names = [line[6:].strip() for line in lines if line.startswith(b"event:")]
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        if not data:
            return KEEPALIVE
        if not names or not names[-1]:
            raise Fault("bad_shape", "sent a stream event without an event: line")
        name, payload = names[-1], b"\n".join(data)
        event = parsed(payload, "sent a stream event")
        if not isinstance(event, dict):
            raise Fault("invalid_json", "sent a stream event that is not a JSON object")
        self.event = event
        if name == b"error":
            fields = plain_fields(event.get("error"), self.secret)
            raise Fault("error_event", "reported an error inside the stream", code="upstream_error", **fields)
        if not self.started and name != b"ping":
            if name != b"message_start":
                raise Fault("bad_shape", "began its stream without message_start")
            self.started = True
        if name == b"message_stop":
            self.done = True
        if self.secret and self.secret.encode() in name:
            name = name.replace(self.secret.encode(), REDACTED.encode())
        payload = scrubbed(payload, event, self.secret)
        return b"event: " + name + b"\ndata: " + payload.replace(b"\n", b"") + b"\n\n"


class AnthropicUpstream(UpstreamTarget):
    endpoints = ("messages", "count_tokens")
    messages_native = True  # the gateway hands it /v1/messages as it came (no ViaChat)

    def url(self, endpoint: str) -> str:
        path = "/messages/count_tokens" if endpoint == "count_tokens" else "/messages"
        return self.provider.base_url.rstrip("/") + path

    def headers(self, request: Request) -> dict:
        version = request.headers.get("anthropic-version") or self.provider.anthropic_version
        out = {"anthropic-version": version}
        beta = request.headers.get("anthropic-beta")
        if beta:
            out["anthropic-beta"] = beta
        for name, value in out.items():
            if not _VERSION.fullmatch(value):
                raise APIError(400, f"the {name} header is not a version name like 2023-06-01", param=name)
        key = self.provider.api_key  # ours, from the config; the client's x-api-key never goes out
        if key:
            out["x-api-key"] = key
        return out

    def events(self, chunks) -> Events:
        return MessagesEvents(chunks, self.provider.api_key)

    def tail(self, error: APIError) -> bytes:
        body = json.dumps(envelope.body(error.status, error.message)).encode()
        return b"event: error\ndata: " + body + b"\n\n"

    def _checked(self, endpoint: str, answer) -> None:
        if endpoint == "count_tokens":
            if not isinstance(answer, dict) or type(answer.get("input_tokens")) is not int:
                raise Fault("bad_shape", "answered 200 with JSON that has no input_tokens count")
            return
        if (
            not isinstance(answer, dict)
            or answer.get("type") != "message"
            or not isinstance(answer.get("content"), list)
        ):
            raise Fault("bad_shape", 'answered 200 with JSON that is not a message (type "message", a content list)')

    def refusal(self, endpoint: str) -> str:
        """Why a request to `endpoint` cannot go here (the gateway's 400)."""
        what = "chat requests (/v1/chat/completions, /v1/responses)" if endpoint == "chat" else f"/v1/{endpoint}"
        return (
            f"{self.name!r} speaks Anthropic's Messages API only ([providers.{self.provider.name}] "
            f'api = "anthropic"): send it to POST /v1/messages; {what} are not translated to Messages'
        )
