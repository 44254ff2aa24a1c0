"""One error envelope for every non-2xx answer, as OpenAI sends it:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

FastAPI's 422 for a malformed body becomes 400 (a client mistake, named field by
field); Starlette's 404/405 get the envelope too; anything unexpected is a 500 whose
message hides the details (they go to the log).
"""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic import envelope as anthropic_envelope

log = logging.getLogger("headwise.serve")

# status -> OpenAI's error type for it
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class APIError(Exception):
    """An answer other than 200, raised anywhere below a route.

    retryable: the gateway may try another target (overload, loading, upstream down);
    a client's own mistake (400) is not retried, it would fail everywhere.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        retryable: bool | None = None,
        body: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after
        self.retryable = retryable if retryable is not None else status in (429, 502, 503, 504)
        self._body = body  # an upstream's own envelope, passed on unchanged

    def body(self) -> dict:
        return self._body or {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return APIError(status, message, **kw).response()


def body_for(path: str, err: APIError) -> dict:
    """The envelope the path's clients read: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    return anthropic_envelope.body(err.status, err.message) if anthropic_envelope.is_anthropic(path) else err.body()


def _respond(request: Request, err: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body_for(request.url.path, err), status_code=err.status, headers=headers or err.headers())


# pydantic names the member of a union it tried in the location: ('stop', 'constrained-str'),
# ('input', 'list[constrained-int]', 0), ('content', 'list[TextPart]', 0, 'type'). Field names
# here are snake_case, so a part with brackets, a dash, a capital or a bare type name is a tag.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|.*[\[\-].*|[A-Z]\w*)$")


def _loc(loc) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path") or (isinstance(part, str) and _UNION_TAG.match(part)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _relevant(errors: list[dict]) -> list[tuple[str, dict]]:
    """A union reports every member's complaint. Where one member got past the type check
    (a list of 17 stops: too long), the members whose type did not even match ("should be a
    valid string", and the same for each item of the list) only bury it: drop those."""
    located = [(_loc(e.get("loc", ())), e) for e in errors]
    specific = {w for w, e in located if not e.get("type", "").endswith("_type")}
    return [
        (w, e)
        for w, e in located
        if not e.get("type", "").endswith("_type")
        or not any(w == s or w.startswith(s + "[") or w.startswith(s + ".") for s in specific)
    ]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = _relevant(exc.errors())
    parts, param = [], None
    for where, e in errors[:5]:
        param = param or where or None
        msg = e.get("msg", "invalid")
        if e.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        elif e.get("type") == "extra_forbidden":
            msg = (
                "unknown field (upstream URLs and keys come only from the server's config)"
                if where.split(".")[-1]
                in ("base_url", "api_base", "api_key", "url", "endpoint", "upstream", "provider")
                else "unknown field"
            )
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more, param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return _respond(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            path = request.url.path
            hint = f" (did you mean {path.rstrip('/')}?)" if path.endswith("/") and len(path) > 1 else ""
            message = f"no route {request.method} {path}{hint}; see /docs for the API"
        return _respond(request, APIError(exc.status_code, message), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _respond(request, APIError(500, f"internal error ({type(exc).__name__}); the server log has details"))
