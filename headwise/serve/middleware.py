"""Two pure-ASGI guards in front of the routes: body size and API keys.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched.
"""
from __future__ import annotations

import hmac
import json

from .errors import APIError

OPEN_PATHS = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json")


async def _send_error(send, err: APIError, extra_headers: list | None = None) -> None:
    body = json.dumps(err.body()).encode()
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
        return APIError(413, f"request body is larger than the server's limit of {self.max_bytes} bytes "
                             "([server] max_body_bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > self.max_bytes:
                    return await _send_error(send, self._too_large(), [(b"connection", b"close")])
            except ValueError:
                return await _send_error(send, APIError(400, "Content-Length is not a number"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, self._too_large(), [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()          # afterwards: http.disconnect when the client leaves

        await self.app(scope, replay, send)


class ApiKeyAuth:
    """Bearer keys, compared in constant time (hmac.compare_digest, against every key,
    so timing reveals neither a key nor which one matched). Keys are never logged:
    the error says only that the key is missing or wrong."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _ok(self, given: bytes) -> bool:
        match = False
        for key in self.keys:
            match |= hmac.compare_digest(given, key)
        return match

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            err = APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        elif not self._ok(token.strip()):
            err = APIError(401, "invalid API key", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await _send_error(send, err, [(b"www-authenticate", b"Bearer")])
