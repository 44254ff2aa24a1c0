"""What the schemathesis tests share: the live server's /openapi.json as schemathesis reads it, and
hypothesis' settings for a `make test` run (HEADWISE_FUZZ_EXAMPLES examples per operation, 25 by
default; Phase.generate only (+ shrink on failure): with Phase.explicit, schemathesis adds its coverage
phase, ~700 boundary cases that take two minutes here); each body strategy built once, not once per
example (build_strategies_once)."""

import copy
import json
import os

import schemathesis
from hypothesis import HealthCheck, Phase, settings

FUZZ_SETTINGS = settings(
    max_examples=int(os.environ.get("HEADWISE_FUZZ_EXAMPLES", "25")),
    deadline=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def openapi_schema(url: str):
    """The server's schema at `url`. The key is ours to send (auth has its own tests); fuzzed headers
    would only meet uvicorn's HTTP parser, which answers malformed ones in plain text before any app
    sees them."""
    build_strategies_once()
    config = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False}})
    return schemathesis.openapi.from_url(url + "/openapi.json", config=config)


_STRATEGIES: dict = {}  # (schema, options) -> its strategy, for the session


def _built_once(real):
    def from_schema(schema, *, custom_formats=None, allow_x00=True, codec="utf-8"):
        formats = tuple(sorted((name, repr(s)) for name, s in (custom_formats or {}).items()))
        key = (json.dumps(schema, sort_keys=True, default=repr), formats, allow_x00, codec)
        if key not in _STRATEGIES:
            _STRATEGIES[key] = real(
                copy.deepcopy(schema), custom_formats=custom_formats, allow_x00=allow_x00, codec=codec
            )
        return _STRATEGIES[key]

    from_schema.built_once = True
    return from_schema


def build_strategies_once():
    """schemathesis calls hypothesis_jsonschema.from_schema anew for every example it draws (~0.3 s each
    for the chat body's schema: canonicalising it and resolving its $refs, 12 of the 14 s its 40 examples
    took). A strategy is a pure function of the schema and the options, so each distinct (schema,
    options) is built once, from a copy: the examples drawn are the ones a fresh build gives (checked:
    the same 40 chat and 40 completions bodies either way). For the session, from `openapi_schema`."""
    from schemathesis.specs.openapi import _hypothesis, negative

    for module in (_hypothesis, negative):
        if not getattr(module.from_schema, "built_once", False):
            module.from_schema = _built_once(module.from_schema)
