"""Schema fuzzing with schemathesis against the live server's /openapi.json: chat,
completions and embeddings get generated valid and invalid bodies; no answer may be a
5xx, and every answer must match the schema (status, content type, headers, body).

Valid bodies are pointed at models that exist (the random tiny Llama, capped at 96
tokens, and MiniLM) so they reach the handlers instead of stopping at 404.
`positive_data_acceptance` is left out: schema-valid requests may still be refused by
design (unknown model, a prompt over the context, unsupported penalties).

HEADWISE_FUZZ_EXAMPLES sets the examples per operation (25 by default, for `make test`):

    HEADWISE_FUZZ_EXAMPLES=300 .venv/bin/python -m pytest tests/serve/test_schema_fuzz.py -q
"""

import pytest

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from .conftest import auth  # noqa: E402
from .fuzzing import FUZZ_SETTINGS, openapi_schema  # noqa: E402

# the filter goes on the lazy schema: it replaces any filter set on the fixture's schema
schema = schemathesis.pytest.from_fixture("api_schema").include(
    path_regex=r"^/v1/(chat/completions|completions|embeddings)$"
)


@pytest.fixture
def api_schema(main):
    return openapi_schema(main.url)


@schema.parametrize()
@FUZZ_SETTINGS
def test_no_server_errors_and_responses_match_the_schema(case):
    if case.meta.generation.mode.is_positive and isinstance(case.body, dict):
        case.body["model"] = "minilm" if case.path.endswith("embeddings") else "tiny"
    case.call_and_validate(headers=auth(), excluded_checks=[positive_data_acceptance], timeout=60)
