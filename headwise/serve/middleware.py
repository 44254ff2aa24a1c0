"""Two pure-ASGI guards in front of the routes: body size and API keys; and the log filters
that keep secrets out of the log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import re

from .errors import APIError, body_for

OPEN_PATHS = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json")
SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature", re.IGNORECASE)
_QUERY = re.compile(r"\?([^\s\"'#]*)")


def redact_query(text: str) -> str:
    """'/v1/models?api_key=sk-1&limit=3' -> '/v1/models?api_key=[redacted]&limit=3': the value of
    every query parameter whose name looks like a credential (key, token, secret, password, ...)."""

    def params(m: re.Match) -> str:
        parts = []
        for part in m.group(1).split("&"):
            name, eq, _ = part.partition("=")
            parts.append(f"{name}=[redacted]" if eq and SECRET_PARAM.search(name) else part)
        return "?" + "&".join(parts)

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


class ApiKeyAuth:
    """Bearer keys, compared in constant time (hmac.compare_digest, against every key,
    so timing reveals neither a key nor which one matched). Keys are never logged:
    the error says only that the key is missing or wrong. Anthropic's clients send the key
    as `x-api-key: <key>` instead: taken when there is no Authorization header."""

    def __init__(self, app, keys: tuple[str, ...], protect_metrics: bool = False):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = tuple(p for p in OPEN_PATHS if not (protect_metrics and p == "/metrics"))

    def _ok(self, given: bytes) -> bool:
        match = False
        for key in self.keys:
            match |= hmac.compare_digest(given, key)
        return match

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if not auth and headers.get(b"x-api-key"):
            scheme, token = b"bearer", headers[b"x-api-key"]
        if scheme.lower() != b"bearer" or not token.strip():
            err = APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key"
            )
        elif not self._ok(token.strip()):
            err = APIError(401, "invalid API key", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await _send_error(send, err, [(b"www-authenticate", b"Bearer")], scope["path"])
