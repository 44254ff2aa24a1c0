"""Tool use on /v1/messages against the live `headwise serve` (SmolLM2 fp32, greedy), through the
official anthropic SDK: a tool_use block whose input validates (jsonschema) against input_schema
and equals the call /v1/chat/completions makes for the same conversation in chat's tool format
(the openai client on the same server: the reference the translation must reproduce), a
tool_result round trip, `messages.stream` with tool use (the SDK's get_final_message() rebuilds
the input from the input_json_delta events). Through the gateway to an OpenAI-style upstream:
test_messages.py (SmolLM2 as its own upstream) and test_tools_upstream.py (a recording fake)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from .conftest import MAIN_KEY
from .test_responses_tools import ASK, CHAT_TOOL, WEATHER, chat_call

TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}
USER = [{"role": "user", "content": ASK}]
GREEDY = {"temperature": 0}
ONE = {
    "type": "any",
    "disable_parallel_tool_use": True,
}  # SmolLM2 would call again and again until max_tokens  # anthropic-python 2.x has no temperature argument; the API takes it


@pytest.fixture(scope="module")
def claude(main):
    return anthropic.Anthropic(base_url=main.url, api_key=MAIN_KEY, max_retries=0, timeout=120)


def _chat_calls(client, messages, model="smollm2", **kw):
    ref = chat_call(client, messages, model=model, **kw)
    return [(t.function.name, json.loads(t.function.arguments)) for t in ref.message.tool_calls or ()]


def test_any_gives_a_tool_use_block_equal_to_chats_call_streamed_or_not(claude, client):
    kw = dict(model="smollm2", max_tokens=48, messages=USER, tools=[TOOL], tool_choice=ONE, extra_body=GREEDY)
    msg = claude.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses
    for b in uses:
        assert b.id.startswith("toolu_") and b.name == "get_weather"
        jsonschema.validate(b.input, WEATHER)
    assert [(b.name, b.input) for b in uses] == _chat_calls(
        client, USER, tool_choice="required", parallel_tool_calls=False
    )
    # count_tokens counts the prompt create read, the tools included
    counted = claude.messages.count_tokens(model="smollm2", messages=USER, tools=[TOOL], tool_choice=ONE).input_tokens
    assert counted == msg.usage.input_tokens > claude.messages.count_tokens(model="smollm2", messages=USER).input_tokens

    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "input_json" in kinds  # the SDK's event for each input_json_delta
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in msg.content]
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip_equals_chats_answer(claude, client):
    use = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C and sunny"}
    convo = [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    msg = claude.messages.create(
        model="smollm2", max_tokens=16, messages=convo, tools=[TOOL], tool_choice={"type": "none"}, extra_body=GREEDY
    )
    call = {
        "id": "toolu_01",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(use["input"])},
    }
    chat = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "21 C and sunny"},
    ]
    ref = client.chat.completions.create(
        model="smollm2", messages=chat, tools=[CHAT_TOOL], tool_choice="none", temperature=0, max_tokens=16
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.choices[0].message.content
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
