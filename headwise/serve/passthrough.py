"""What the gateway reads of a request before it picks a target, and the strict check a target asks for.

Routes take their body raw. The gateway itself needs only a JSON object whose `model` is a
non-empty string and whose `stream`, if there, is a bool (the body limit and the API key were
checked before: middleware.py). Then each target gets what it can use:

    an upstream provider (upstream.py)     the body as the client sent it, `model` renamed: every
                                           field it accepts (tool_choice "required", reasoning_effort,
                                           prediction, a field OpenAI adds next month) reaches it
    a local model, a replica set           the body validated by the strict schemas (schemas.py,
    (headwise servers), ViaChat            anthropic/schemas.py): the 400s FastAPI gave when every
                                           route validated its body, and failover.py reads a body
                                           whose shape it knows

On a route that mixes both, the check runs when a local target is drawn: its 400 is the client's
mistake for that target, not a reason to try another.

/openapi.json still documents the request bodies: `documented()` makes a twin of each raw route,
typed with its schema, that only the schema generator sees.
"""

from __future__ import annotations

import inspect
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from .anthropic.schemas import CountTokensRequest, MessagesRequest
from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

SCHEMAS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
    "messages": MessagesRequest,
    "count_tokens": CountTokensRequest,
}


class Incoming:
    """One request's body as the client sent it (`raw`), validated only when a target asks."""

    def __init__(self, endpoint: str, raw: dict, validated: BaseModel | None = None):
        self.endpoint, self.raw, self._validated = endpoint, raw, validated
        self.model: str = raw["model"]

    @classmethod
    def of(cls, endpoint: str, req: BaseModel) -> Incoming:
        """A request validated already (responses.py's chat request): the body is its fields as set."""
        return cls(endpoint, req.model_dump(mode="json", exclude_unset=True), req)

    def validated(self) -> BaseModel:
        """The strict schema's model; a RequestValidationError (the app's 400, field by field) if not."""
        if self._validated is None:
            self._validated = strict(self.endpoint, self.raw)
        return self._validated

    def strict_body(self) -> dict:
        """What a strict target gets as its body: the validated fields the client set."""
        return self.validated().model_dump(mode="json", exclude_unset=True)


def strict(endpoint: str, body) -> BaseModel:
    """`body` validated by `endpoint`'s schema, or the RequestValidationError FastAPI would raise."""
    try:
        return SCHEMAS[endpoint].model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, endpoint: str) -> Incoming:
    """The body's bytes -> Incoming, or a 400 naming what the gateway cannot route."""
    if not raw.strip():
        raise APIError(400, "the body is empty; send a JSON object with `model` and the request's fields")
    try:
        # NaN / Infinity are not JSON (RFC 8259): refused here, as an upstream would refuse them
        body = json.loads(raw, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply") from None
    if (
        isinstance(body, dict)
        and isinstance(body.get("model"), str)
        and body["model"]
        and isinstance(body.get("stream", False), (bool, type(None)))
    ):
        return Incoming(endpoint, body)
    # what the gateway needs is missing: the strict schema names it (and any other mistake) as it always has
    strict(endpoint, body)
    raise APIError(400, "the body must be a JSON object with `model` a non-empty string", param="model")


async def read(request: Request, endpoint: str) -> Incoming:
    return parse(await request.body(), endpoint)


def documented(path: str, endpoint: str, name: str, **route: object) -> APIRoute:
    """A POST route typed with `endpoint`'s schema, for /openapi.json only (never mounted): the raw
    route at `path` answers, this one says what it takes."""

    async def twin(req):  # never called
        raise NotImplementedError

    param = inspect.Parameter("req", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=SCHEMAS[endpoint])
    twin.__signature__ = inspect.Signature([param])
    return APIRoute(path, twin, methods=["POST"], name=name, **route)
