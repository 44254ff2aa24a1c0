"""What the schemathesis tests share: the live server's /openapi.json as schemathesis reads it, and
hypothesis' settings for a `make test` run (HEADWISE_FUZZ_EXAMPLES examples per operation, 40 by
default; Phase.generate only (+ shrink on failure): with Phase.explicit, schemathesis adds its coverage
phase, ~700 boundary cases that take two minutes here)."""

import os

import schemathesis
from hypothesis import HealthCheck, Phase, settings

FUZZ_SETTINGS = settings(
    max_examples=int(os.environ.get("HEADWISE_FUZZ_EXAMPLES", "40")),
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
    config = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False}})
    return schemathesis.openapi.from_url(url + "/openapi.json", config=config)
