"""response_format against a live `headwise serve` (SmolLM2), through the official openai client:
`parse` with a pydantic model, json_schema / json_object / regex (ours) on chat and completions,
streamed, concurrent; a bad or unsupported schema is a 400 in OpenAI's envelope naming the problem.
Answers are judged by `jsonschema` and by generate() under the same grammar in this process."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import headwise
from headwise.runtime.grammar import grammar_processor

from .conftest import auth

SCHEMAS = json.loads((Path(__file__).parents[1] / "fixtures" / "schemas" / "schemas.json").read_text())


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def schema_format(item) -> dict:
    return {"type": "json_schema", "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True}}


def test_parse_with_a_pydantic_model_returns_the_object(client):
    res = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format=Person,
        max_tokens=48,
        temperature=0,
    )
    parsed = res.choices[0].message.parsed
    assert isinstance(parsed, Person) and res.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(res.choices[0].message.content) == parsed


def test_json_schema_answer_is_generates_under_the_same_grammar(client, smol):
    item = next(s for s in SCHEMAS if s["name"] == "weather")
    msgs = [{"role": "user", "content": item["prompt"]}]
    res = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=64, temperature=0, response_format=schema_format(item)
    )
    text = res.choices[0].message.content
    jsonschema.validate(json.loads(text), item["schema"])
    proc = grammar_processor(smol.tokenizer, schema_format(item), vocab_size=smol.config.vocab_size)
    ref = headwise.generate(smol, msgs, max_new_tokens=64, temperature=0, logits_processors=(proc,))
    assert text == ref.text and res.choices[0].finish_reason == ref.finish_reason == "stop"


def test_streamed_json_schema(client):
    item = next(s for s in SCHEMAS if s["name"] == "person")
    chunks = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": item["prompt"]}],
        max_tokens=64,
        temperature=0,
        stream=True,
        response_format=schema_format(item),
    )
    pieces, reasons = [], []
    for c in chunks:
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            reasons.append(c.choices[0].finish_reason)
    text = "".join(pieces)
    assert reasons[-1] == "stop", text
    jsonschema.validate(json.loads(text), item["schema"])


def test_json_object(client):
    res = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is water wet? Answer as JSON."}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = res.choices[0].message.content
    if res.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # an object has no bound on its length: cut by max_tokens, it is still an object's prefix
        assert text.startswith("{") and res.choices[0].finish_reason == "length", text


def test_completions_take_a_schema_and_a_regex(client):
    item = next(s for s in SCHEMAS if s["name"] == "person")
    res = client.completions.create(
        model="smollm2",
        prompt="A person as JSON:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": schema_format(item)},
    )
    jsonschema.validate(json.loads(res.choices[0].text), item["schema"])
    pattern = r"[A-Z][a-z]+, [0-9]{4}"
    res = client.completions.create(
        model="smollm2",
        prompt="The capital of France and a year:",
        max_tokens=16,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "pattern": pattern}},
    )
    assert res.choices[0].finish_reason == "stop" and re.fullmatch(pattern, res.choices[0].text)


def test_concurrent_requests_with_different_schemas(aclient):
    items = SCHEMAS[:6]

    async def one(c, item):
        msgs = [{"role": "user", "content": item["prompt"]}]
        res = await c.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=64, temperature=0, response_format=schema_format(item)
        )
        return res.choices[0]

    async def run():
        c = aclient()
        return await asyncio.gather(*(one(c, i) for i in items))

    for item, choice in zip(items, asyncio.run(run())):
        assert choice.finish_reason == "stop", (item["name"], choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), item["schema"])


@pytest.mark.parametrize(
    "fmt, named",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
        ),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "null"}}}}, '"not"'),
        ({"type": "json_schema", "json_schema": {"name": "s"}}, "json_schema.schema"),
        ({"type": "regex"}, "needs a pattern"),
        ({"type": "regex", "pattern": "(unclosed"}, "unsupported regex"),
    ],
)
def test_a_bad_or_unsupported_format_is_a_400_naming_it(client, fmt, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=fmt
        )
    err = e.value.body
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error", err
    assert named in err["message"], err


def test_completions_400_is_the_same_envelope(main):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"contains": {"type": "integer"}}}}
    r = httpx.post(
        main.url + "/v1/completions",
        headers=auth(),
        json={"model": "smollm2", "prompt": "x", "max_tokens": 4, "response_format": fmt},
        timeout=60,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "contains" in err["message"], err
