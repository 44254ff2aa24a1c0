"""Two pure-ASGI guards in front of the routes: body size and API keys; and the log filters
that keep secrets out of the log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import re
import urllib.parse

from .errors import APIError, body_for

OPEN_PATHS = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json")
# a parameter name holding any of these is a secret (api_key, X-Amz-Signature, session_id, id_token) ...
SECRET_PARAM = re.compile(
    r"key|token|secret|passw|pwd|auth|credential|signature|session|bearer|jwt|cookie", re.IGNORECASE
)
# ... and so is one whose name has one of these as a word (sig=, sid=, code= of OAuth, otp=)
SECRET_WORDS = frozenset(("sig", "sid", "code", "otp", "sas", "pin"))
# the query runs to the end of the URL: quotes and other punctuation are part of it
# (`?api_key="sk-1"` once left the key after the quote in the log)
_QUERY = re.compile(r"\?([^\s#]*)")

# Whether this request may use headwise's internal request fields (headwise.resume): set by
# ApiKeyAuth from [server] accept_resume, read by the endpoints (openai/common.py require_peer).
PEER: contextvars.ContextVar[bool] = contextvars.ContextVar("headwise_peer", default=False)


def _unquoted(text: str) -> str:
    """URL-decoded until it no longer changes (twice-encoded names too), at most 3 rounds."""
    for _ in range(3):
        plain = urllib.parse.unquote_plus(text)
        if plain == text:
            break
        text = plain
    return text


def secret_name(name: str) -> bool:
    name = _unquoted(name)
    return bool(SECRET_PARAM.search(name)) or any(w in SECRET_WORDS for w in re.split(r"[^a-z0-9]+", name.lower()))


def redact_query(text: str) -> str:
    """'/v1/models?api_key=sk-1&limit=3' -> '/v1/models?api_key=[redacted]&limit=3': the value of
    every query parameter whose name looks like a credential (secret_name), however its name is
    encoded (api%5Fkey) and whatever its value holds (quotes, an encoded '=': api_key%3Dsk-1)."""

    def params(m: re.Match) -> str:
        parts = []
        for part in re.split(r"([&;])", m.group(1)):
            if part in ("&", ";"):
                parts.append(part)
                continue
            name, eq, _ = part.partition("=")
            if not eq:  # the '=' itself may be encoded
                name, eq, _ = _unquoted(part).partition("=")
            parts.append(f"{_unquoted(name)}=[redacted]" if eq and secret_name(name) else part)
        return "?" + "".join(parts)

    return _QUERY.sub(params, text) if "?" in text else text


class RedactQuery(logging.Filter):
    """On uvicorn's access log (and httpx's request log): secrets in query strings never reach
    a handler. The access line's args are (client, method, path?query, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact_query(a) if isinstance(a, str) else redact_query(str(a)) if type(a).__name__ == "URL" else a
                for a in record.args
            )
        elif not record.args and isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


class HideResponseHeaders(logging.Filter):
    """httpcore's DEBUG trace prints upstream response headers verbatim, and an upstream may echo
    our Authorization header back: keep the trace, drop the headers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("receive_response_headers.complete"):
            record.msg, record.args = "receive_response_headers.complete (headers not logged)", ()
        return True


def install_log_filters() -> None:
    """Once per process (create_app calls it; uvicorn's logging setup keeps logger filters)."""
    for name, cls in (
        ("uvicorn.access", RedactQuery),
        ("httpx", RedactQuery),
        ("httpcore.http11", HideResponseHeaders),
        ("httpcore.http2", HideResponseHeaders),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


async def _send_error(send, err: APIError, extra_headers: list | None = None, path: str = "") -> None:
    body = json.dumps(body_for(path, err)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()] + (extra_headers or [])
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else
    while reading a chunked body (the body is read here, up to the limit, and then
    replayed to the app, so the app never sees a partial body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than the server's limit of {self.max_bytes} bytes ([server] max_body_bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > self.max_bytes:
                    return await _send_error(send, self._too_large(), [(b"connection", b"close")], scope["path"])
            except ValueError:
                return await _send_error(send, APIError(400, "Content-Length is not a number"), path=scope["path"])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, self._too_large(), [(b"connection", b"close")], scope["path"])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: http.disconnect when the client leaves

        await self.app(scope, replay, send)


def sent_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The API key a request sent (its ASGI headers as a dict): `Authorization: Bearer <key>`, or
    Anthropic's `x-api-key: <key>` when there is no Authorization header; None otherwise."""
    auth = headers.get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    if not auth and headers.get(b"x-api-key"):
        scheme, token = b"bearer", headers[b"x-api-key"]
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


class ApiKeyAuth:
    """Bearer keys, compared in constant time (hmac.compare_digest, against every key,
    so timing reveals neither a key nor which one matched). Keys are never logged:
    the error says only that the key is missing or wrong. Anthropic's clients send the key
    as `x-api-key: <key>` instead: taken when there is no Authorization header.

    accept_resume ([server] accept_resume) says who may send headwise.resume, the gateway's field
    for moving a stream between replicas (failover.py), which makes the server read the ids sent
    as output so far and replay a seed's draws: "keyed" (default) a request with one of the keys
    (the gateway's [replicas] api_key_env), so a server without keys refuses it; "always" anyone
    (replicas on a private network without keys); "never" no one."""

    def __init__(self, app, keys: tuple[str, ...], protect_metrics: bool = False, accept_resume: str = "keyed"):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = tuple(p for p in OPEN_PATHS if not (protect_metrics and p == "/metrics"))
        self.accept_resume = accept_resume

    def _ok(self, given: bytes) -> bool:
        match = False
        for key in self.keys:
            match |= hmac.compare_digest(given, key)
        return match

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        PEER.set(self.accept_resume == "always")  # this request's task only
        if not self.keys or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        key = sent_key(dict(scope.get("headers") or []))
        if key is None:
            err = APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key"
            )
        elif not self._ok(key):
            err = APIError(401, "invalid API key", code="invalid_api_key")
        else:
            PEER.set(self.accept_resume != "never")
            return await self.app(scope, receive, send)
        await _send_error(send, err, [(b"www-authenticate", b"Bearer")], scope["path"])
