"""Function tools on /v1/responses against the live `headwise serve` (SmolLM2 fp32, greedy), through
the official openai client: every call's arguments validate (jsonschema) against the tool's
parameters, and each answer equals the one /v1/chat/completions gives for the same conversation in
chat's tool format (the same client, the same server's chat route: the reference the translation
must reproduce). The gateway's translation to an upstream: tests/serve/test_tools_upstream.py."""

from __future__ import annotations

import json

import jsonschema

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
}
ASK = "What is the weather in Paris?"


def chat_call(client, messages, model="smollm2", **kw):
    res = client.chat.completions.create(
        model=model, messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=48, **kw
    )
    return res.choices[0]


def test_required_call_validates_equals_chats_and_streams(client):
    kw = dict(
        model="smollm2",
        input=ASK,
        tools=[{**TOOL, "strict": True}],
        tool_choice="required",
        parallel_tool_calls=False,  # SmolLM2 would call again and again until max_output_tokens
        temperature=0,
        max_output_tokens=48,
    )
    res = client.responses.create(**kw)
    calls = [o for o in res.output if o.type == "function_call"]
    assert res.status == "completed" and calls and res.tools[0].name == "get_weather"
    for c in calls:
        assert c.name == "get_weather" and c.id.startswith("fc_") and c.call_id and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    ref = chat_call(client, [{"role": "user", "content": ASK}], tool_choice="required", parallel_tool_calls=False)
    assert ref.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in ref.message.tool_calls
    ]

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(a for _, a in got)
    jsonschema.validate(final.output[-1].parsed_arguments, WEATHER)  # strict: the SDK parses the arguments


def test_function_call_output_round_trip_equals_chats(client):
    """The call and its output sent back as input items: the answer is chat's for the same turns."""
    args = '{"city": "Paris", "unit": "c"}'
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C and sunny"},
    ]
    res = client.responses.create(
        model="smollm2", input=items, tools=[TOOL], tool_choice="none", temperature=0, max_output_tokens=16
    )
    convo = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    ref = client.chat.completions.create(
        model="smollm2", messages=convo, tools=[CHAT_TOOL], tool_choice="none", temperature=0, max_tokens=16
    )
    assert res.output_text == ref.choices[0].message.content and res.output_text
    assert [o.type for o in res.output] == ["message"]


def test_through_the_gateway_to_a_headwise_upstream(client):
    """peer/tiny: the gateway sends an ordinary chat request with tools to another headwise server
    (a random model of 256 positions: a few tokens of a call, cut by max_output_tokens)."""
    res = client.responses.create(
        model="peer/tiny", input=ASK, tools=[TOOL], tool_choice="required", temperature=0, max_output_tokens=12
    )
    ref = client.chat.completions.create(
        model="peer/tiny", messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL], tool_choice="required",
        temperature=0, max_tokens=12,
    ).choices[0]  # fmt: skip
    calls = [o for o in res.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (t.function.name, t.function.arguments) for t in ref.message.tool_calls or ()
    ]
    assert res.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    if res.status == "incomplete" and calls:  # the call max_output_tokens cut short says so
        assert calls[-1].status == "incomplete"
