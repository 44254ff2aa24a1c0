"""Anthropic's error envelope, which its clients read on /v1/messages:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

Types by status as https://docs.anthropic.com/en/api/errors lists them. Imports nothing of
serve: errors.py and the middleware pick this envelope by path.
"""

from __future__ import annotations

PATHS = ("/v1/messages",)

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # a model loading or draining: Anthropic's "temporarily overloaded"
    504: "timeout_error",
    529: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PATHS)


def body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": TYPES.get(status, "api_error"), "message": message}}
