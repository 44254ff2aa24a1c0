"""An upstream OpenAI-compatible provider as a gateway target: forward, then check what comes back.

Nothing an upstream writes is relayed as text. Its error bodies may echo the request, our
configured key included, so an upstream error becomes our own message (status, target, a
hint) keeping only OpenAI's `type` / `code` / `param` when they are short plain identifiers.
A 200 must carry what the endpoint promises: a JSON object with `choices` (`data` for
embeddings); a stream, SSE events whose data is a JSON object, ended by `data: [DONE]`.
A fault found before the first byte is a 502 (retryable: the route may try elsewhere); one
found later ends the stream with an error event and `data: [DONE]`. Either way the target
is told (`settle(False)`), so faults count toward its cooldown as a 5xx does.
What is relayed has our key scrubbed from every JSON string (upstream_body.py); a body held whole
is read under [providers.NAME] max_response_bytes (after decoding: no gzip bomb); a stream ends
with an error event when no event came for idle_timeout (`:` keep-alives do not count) or the
request passed total_timeout.
The body goes out as the client sent it, `model` renamed (passthrough.py): the upstream, not our
schema, decides which fields it accepts. anthropic_upstream.py is the same for Anthropic's Messages.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
from fastapi import Request
from fastapi.responses import Response

from .config import Provider
from .errors import APIError
from .openai.common import SSE_DONE, sse
from .openai.streams import EventStream
from .upstream_body import ACCEPT_ENCODING, Fault, decoded, parsed, read_capped, scrubbed

log = logging.getLogger("headwise.serve")

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
SHAPE = {"chat": "choices", "completions": "choices", "embeddings": "data"}  # the list a 200 must have
MAX_EVENT_BYTES = 1 << 20  # one SSE event; beyond this the upstream is not sending events
MAX_ERROR_BYTES = 1 << 20  # an error body: its type / code / param are all we keep
KEEPALIVE = b":\n\n"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,63}")  # context_length_exceeded, messages[0].content
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")


def plain_fields(error, secret: str | None) -> dict:
    """type / code / param of an upstream's error object, each only if it is a short plain
    identifier (no spaces, dashes, quotes: a key or an echoed header is none of those)."""
    if not isinstance(error, dict):
        return {}
    out = {}
    for field in ("type", "code", "param"):
        value = error.get(field)
        if isinstance(value, str) and _IDENTIFIER.fullmatch(value) and not (secret and secret in value):
            out[field] = value
    return out


class Events:
    """SSE events from an upstream's bytes, each checked and scrubbed of `secret`; yields them
    framed anew (data lines only; comments and other fields become a bare `:` keep-alive)."""

    END = "data: [DONE]"  # what a whole stream ends with

    def __init__(self, chunks, secret: str | None):
        self.chunks, self.secret, self.buf, self.done = chunks, secret, b"", False
        self.event: dict | None = None
        self.idle = self.end = self.heard = None

    def deadlines(self, idle: float, total: float, start: float, where: str) -> None:
        """From now on next() raises Fault when no event (a keep-alive is none) came for `idle`
        seconds or `total` seconds passed since `start` (the loop's clock); `where` names the
        settings ("[providers.x] ")."""
        self.idle, self.total, self.end, self.where = idle, total, start + total, where
        self.heard = asyncio.get_running_loop().time()

    async def next(self) -> bytes | None:
        """The next event, or None when the upstream's stream ends. Raises Fault."""
        if self.idle is None:
            return await self._read()
        idle_end = self.heard + self.idle
        try:
            async with asyncio.timeout_at(min(idle_end, self.end)):
                event = await self._read()
        except TimeoutError:
            if idle_end <= self.end:
                what = f"sent no event for {self.idle:g} s ({self.where}idle_timeout)"
            else:
                what = f"did not end its stream within {self.total:g} s ({self.where}total_timeout)"
            raise Fault("timeout", what, code="upstream_timeout") from None
        if event != KEEPALIVE:
            self.heard = asyncio.get_running_loop().time()
        return event

    async def _read(self) -> bytes | None:
        while True:
            m = _EVENT_END.search(self.buf)
            if m:
                raw, self.buf = self.buf[: m.start()], self.buf[m.end() :]
                if raw.strip():
                    return self._check(raw)
                continue
            if len(self.buf) > MAX_EVENT_BYTES:
                raise Fault("oversized", f"sent an event over {MAX_EVENT_BYTES} bytes")
            chunk = await anext(self.chunks, None)
            if chunk is None:  # the end: a last event may lack its blank line
                raw, self.buf = self.buf, b""
                return self._check(raw) if raw.strip() else None
            self.buf += chunk

    def _check(self, raw: bytes) -> bytes:
        data = [line[5:].removeprefix(b" ") for line in _LINE.split(raw) if line.startswith(b"data:")]
        if not data:
            return KEEPALIVE
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self.done = True
            return SSE_DONE
        event = parsed(payload, "sent a stream event")
        if not isinstance(event, dict):
            raise Fault("invalid_json", "sent a stream event that is not a JSON object")
        self.event = event  # the parsed object, for a reader that looks inside (failover.py)
        if "error" in event:
            fields = plain_fields(event["error"], self.secret)
            raise Fault(
                "error_event",
                "reported an error inside the stream",
                code=fields.pop("code", "upstream_error"),
                **fields,
            )
        clean = scrubbed(payload, event, self.secret)
        if clean is not payload:  # one data line: what it says, the key replaced
            return b"data: " + clean + b"\n\n"
        return b"".join(b"data: " + d + b"\n" for d in data) + b"\n"


class UpstreamTarget:
    """An OpenAI-compatible server; requests are forwarded with `model` renamed, answers
    checked and passed back (streams event for event). The timeout covers the wait for the
    first byte (for a stream, its first event): for a non-streamed answer, the whole answer;
    after the first event, a stream has its provider's idle_timeout and total_timeout."""

    settles_streams = True  # a stream's outcome is known at its end: the gateway's settle(ok)
    takes_raw = True  # the client's body as sent, not our schema's validated copy (passthrough.py)
    endpoints = ("chat", "completions", "embeddings", "messages")  # messages: translated (ViaChat)

    def __init__(self, name: str, provider: Provider, model: str, client: httpx.AsyncClient):
        self.name, self.provider, self.model, self.client = name, provider, model, client
        self.owner = provider.name

    def _error(self, status: int, content: bytes, headers) -> APIError:
        try:
            body = parsed(content, "sent an error")
        except Fault:  # too large, not JSON: the status alone says what happened
            body = None
        fields = plain_fields(body.get("error") if isinstance(body, dict) else None, self.provider.api_key)
        log.warning("upstream %s answered %d (%d bytes; its text is not relayed)", self.name, status, len(content))
        where = f"upstream {self.name}"
        if status in (400, 413, 422):  # the client's request: the same anywhere, not retried
            named = f" ({fields['param']})" if "param" in fields else ""
            hint = "the request is too large for it" if status == 413 else f"check the request's fields{named}"
            said = f", {fields['code']}" if "code" in fields else ""
            return APIError(
                400 if status == 422 else status,
                f"{where} rejected the request ({status}{said}): {hint}",
                code=fields.get("code"),
                param=fields.get("param"),
                type=fields.get("type"),
            )
        if status == 529:  # Anthropic's "overloaded"
            return APIError(503, f"{where} is overloaded (529); retry later", code="upstream_overloaded")
        if status == 429:
            retry = headers.get("retry-after")
            return APIError(
                429,
                f"{where} is rate limiting (429); retry later",
                code="upstream_rate_limited",
                retry_after=float(retry) if retry and retry.isdigit() else None,
            )
        if status in (401, 403):  # our configured key, not the client's
            return APIError(
                502,
                f"{where} refused the configured key ({status}); check {self.provider.api_key_env}",
                code="upstream_auth",
            )
        if status == 404:
            return APIError(
                502,
                f"{where} answered 404; check [providers.{self.provider.name}] base_url and that "
                f"it serves model {self.model!r}",
                code="upstream_error",
            )
        return APIError(502, f"{where} failed ({status}); its own logs have the details", code="upstream_error")

    def _fault(self, fault: Fault, metrics, status: int = 502) -> APIError:
        log.warning("upstream %s %s", self.name, fault.what)
        if metrics:
            metrics.fault(self.name, fault.kind)
        return APIError(status, f"upstream {self.name} {fault.what}", code=fault.code, **fault.fields)

    def _checked(self, endpoint: str, answer) -> None:
        """Raises Fault when a 200's parsed JSON is not what `endpoint` promises."""
        if not isinstance(answer, dict) or not isinstance(answer.get(SHAPE[endpoint]), list):
            raise Fault("bad_shape", f"answered 200 with JSON that has no {SHAPE[endpoint]!r} list")

    async def _answer(self, endpoint: str, resp) -> bytes:
        """A non-streamed 200's body: read under the cap, checked, scrubbed."""
        setting = f"[providers.{self.provider.name}] max_response_bytes"
        content = await read_capped(decoded(resp), self.provider.max_response_bytes, setting)
        answer = parsed(content, "answered 200 with a body")
        self._checked(endpoint, answer)
        return scrubbed(content, answer, self.provider.api_key)

    # ---- what differs between the APIs an upstream may speak (anthropic_upstream.py) ----------
    def url(self, endpoint: str) -> str:
        return self.provider.base_url.rstrip("/") + PATHS[endpoint]

    def headers(self, request: Request) -> dict:
        key = self.provider.api_key  # ours, from the config; the client's never goes out
        return {"Authorization": f"Bearer {key}"} if key else {}

    def events(self, chunks) -> Events:
        return Events(chunks, self.provider.api_key)

    def tail(self, error: APIError) -> bytes:
        """How a stream that broke after its first byte ends."""
        return sse(error.body()) + SSE_DONE

    async def handle(self, endpoint: str, req, body: dict, request: Request, model: str, timeout, metrics, settle=None):
        """-> the answer. A stream reports how it ended through settle(ok); a client that
        hangs up reports nothing."""
        limit = min(timeout or self.provider.timeout, self.provider.total_timeout)
        start = asyncio.get_running_loop().time()
        upstream = self.client.build_request(
            "POST",
            self.url(endpoint),
            json={**body, "model": self.model},
            headers={**self.headers(request), "Accept-Encoding": ACCEPT_ENCODING},  # what decoded() reads
            timeout=httpx.Timeout(self.provider.timeout, connect=limit),
        )
        resp, streaming = None, False
        try:
            async with asyncio.timeout(limit):  # until the first byte
                resp = await self.client.send(upstream, stream=True)
                if resp.status_code != 200:
                    try:
                        content = await read_capped(decoded(resp), MAX_ERROR_BYTES, "an error body")
                    except Fault:
                        content = b""
                    raise self._error(resp.status_code, content, resp.headers)
                if not body.get("stream"):
                    return Response(await self._answer(endpoint, resp), media_type="application/json")
                events = self.events(decoded(resp))  # the upstream may gzip, our answer does not
                head = [await events.next()]
                while head[-1] == KEEPALIVE:
                    head.append(await events.next())
                if head[-1] is None:
                    raise Fault("truncated", "ended the stream before its first event")
                streaming = True
                p = self.provider
                events.deadlines(p.idle_timeout, p.total_timeout, start, f"[providers.{p.name}] ")
        except Fault as f:
            raise self._fault(f, metrics) from None
        except TimeoutError:
            raise APIError(
                504, f"upstream {self.name} sent nothing within {limit:g} s", code="upstream_timeout"
            ) from None
        except httpx.HTTPError as e:
            raise APIError(
                502, f"upstream {self.name} is unreachable ({type(e).__name__})", code="upstream_unreachable"
            ) from None
        finally:
            if resp is not None and not streaming:
                await resp.aclose()

        async def relay():
            ended = ok = False
            try:
                for event in head:
                    yield event
                while not events.done:
                    event = await events.next()
                    if event is None:
                        raise Fault("truncated", f"ended the stream without {events.END}", code="upstream_truncated")
                    yield event
                ended = ok = True
            except Fault as f:
                ended = True
                yield self.tail(self._fault(f, metrics))
            except httpx.HTTPError as e:
                ended = True
                broken = Fault("broken", f"broke off the stream ({type(e).__name__})", code="upstream_error")
                yield self.tail(self._fault(broken, metrics))
            finally:
                await resp.aclose()  # a client that hangs up closes the upstream stream too
                if ended and settle:
                    settle(ok)

        return EventStream(relay(), request)  # a client that reads nothing is cut off ([server] stall_timeout)
