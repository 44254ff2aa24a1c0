"""Predicted Outputs on /v1/chat/completions, through the official openai client against the live
`main` server (SmolLM2): the answer with `prediction` is the answer without it (greedy, and seeded
sampling), streamed or not, under a response_format; usage.completion_tokens_details carries
accepted_prediction_tokens / rejected_prediction_tokens as OpenAI's does; a prediction that is not
{"type": "content", ...} is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

TEXT = "The quick brown fox jumps over the lazy dog. It barked twice, then slept until noon."
EDITED = TEXT.replace("twice", "three times")
MESSAGES = [{"role": "user", "content": f"Repeat exactly: {EDITED}"}]


def ask(client, **kw):
    return client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, **kw)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}])
def test_prediction_changes_speed_not_the_answer(client, sampling):
    plain = ask(client, **sampling)
    predicted = ask(client, prediction={"type": "content", "content": TEXT}, **sampling)
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens
    details = predicted.usage.completion_tokens_details
    if sampling["temperature"] == 0:  # the answer repeats the text: most of it followed the prediction
        assert details.accepted_prediction_tokens > predicted.usage.completion_tokens // 2
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    assert plain.usage.completion_tokens_details is None or not (
        plain.usage.completion_tokens_details.accepted_prediction_tokens
    )


def test_streamed_with_a_prediction_is_the_same_text(client):
    plain = ask(client, temperature=0).choices[0].message.content
    parts = [{"type": "text", "text": TEXT[:30]}, {"type": "text", "text": TEXT[30:]}]  # content as parts
    stream = ask(
        client, temperature=0, prediction={"type": "content", "content": parts}, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_prediction_under_a_schema(client):
    schema = {
        "type": "object",
        "properties": {
            "animal": {"type": "string", "maxLength": 12},
            "times": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["animal", "times"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    plain = ask(client, temperature=0, response_format=fmt).choices[0].message.content
    got = ask(
        client,
        temperature=0,
        response_format=fmt,
        prediction={"type": "content", "content": '{"animal":"fox","times":2}'},
    )
    assert got.choices[0].message.content == plain
    jsonschema.validate(json.loads(plain), schema)


@pytest.mark.parametrize(
    "prediction, why",
    [({"type": "text", "content": "x"}, "type"), ({"content": "x"}, "type"), ({"type": "content"}, "content")],
)
def test_bad_predictions_are_400s(client, prediction, why):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, prediction=prediction)
    assert e.value.status_code == 400 and "prediction" in str(e.value.body) and why in str(e.value.body)
