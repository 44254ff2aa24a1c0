"""Tools on /v1/responses and /v1/messages translated to an OpenAI-style upstream and back: the
gateway (no local model) in front of a fake chat upstream that records each request it receives
and answers OpenAI's chat tool-call format as OpenAI documents it (tool_calls with JSON-text
arguments, finish_reason "tool_calls"; streamed `delta.tool_calls` with the id and name first,
then argument fragments). The clients are the official `openai` and `anthropic` SDKs, whose own
stream accumulators rebuild the answer; the recorded requests are compared with the chat format
the translation must produce."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from .conftest import LiveServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
ARGS = {"weather": '{"city": "Paris", "unit": "c"}', "time": '{"zone": "CET"}'}


def _upstream(seen: list):
    """Calls each tool once (the named one only; only the first when parallel_tool_calls is false);
    with no tools or tool_choice "none", says "plain"."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def calls(body):
        tools = [t["function"]["name"] for t in body.get("tools") or ()]
        choice = body.get("tool_choice")
        if not tools or choice == "none":
            return []
        if isinstance(choice, dict):
            tools = [choice["function"]["name"]]
        if body.get("parallel_tool_calls") is False:
            tools = tools[:1]
        return [(f"call_{i}{name}", name, ARGS[name]) for i, name in enumerate(tools)]

    async def chat(request):
        body = await request.json()
        seen.append(body)
        made = calls(body)
        finish = "tool_calls" if made else "stop"
        usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "up"}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": None if made else "plain"}
            if made:
                msg["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in made
                ]
            choice = {"index": 0, "message": msg, "finish_reason": finish}
            return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": usage})

        def chunk(delta, finish_reason=None):
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"

        events = [chunk({"role": "assistant", "content": ""})]
        if not made:
            events += [chunk({"content": "pla"}), chunk({"content": "in"})]
        for k, (i, n, a) in enumerate(made):
            first = {"index": k, "id": i, "type": "function", "function": {"name": n, "arguments": ""}}
            events.append(chunk({"tool_calls": [first]}))
            cut = [a[:5], a[5:12], a[12:]]
            events += [chunk({"tool_calls": [{"index": k, "function": {"arguments": p}}]}) for p in cut]
        events.append(chunk({}, finish))
        events.append(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")

        async def gen():
            for e in events:
                yield e

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


@pytest.fixture(scope="module")
def gateway():
    from headwise.serve import create_app, parse_config

    seen: list = []
    upstream = LiveServer(_upstream(seen)).start()
    config = {
        "server": {"api_key_env": ""},
        "providers": {"up": {"base_url": upstream.url + "/v1", "models": ["m"], "timeout": 10}},
    }
    live = LiveServer(create_app(parse_config(config))).start()
    live.seen = seen
    yield live
    live.stop()
    upstream.stop()


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0, timeout=30)


# ---------------------------------------------------------------- Responses
FN_TOOLS = [
    {"type": "function", "name": "weather", "description": "Weather in a city", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "time", "parameters": TIME, "strict": None},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Weather in a city", "parameters": WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]


def test_responses_tools_go_out_as_chat_tools_and_calls_come_back(oai, gateway):
    res = oai.responses.create(model="up/m", input="Weather and time in Paris?", tools=FN_TOOLS, tool_choice="required")
    sent = gateway.seen[-1]
    assert sent["tools"] == CHAT_TOOLS and sent["tool_choice"] == "required"
    assert res.status == "completed" and [o.type for o in res.output] == ["function_call", "function_call"]
    for item, name in zip(res.output, ("weather", "time")):
        assert item.id.startswith("fc_") and item.call_id == f"call_{'01'[name == 'time']}{name}"
        assert item.name == name and json.loads(item.arguments) == json.loads(ARGS[name])
        assert item.status == "completed"
    assert [t.name for t in res.tools] == ["weather", "time"] and res.tool_choice == "required"
    assert res.usage.input_tokens == 11 and res.usage.output_tokens == 7

    named = oai.responses.create(
        model="up/m", input="x", tools=FN_TOOLS, tool_choice={"type": "function", "name": "time"}, max_tool_calls=1
    )
    assert gateway.seen[-1]["tool_choice"] == {"type": "function", "function": {"name": "time"}}
    assert gateway.seen[-1]["parallel_tool_calls"] is False  # max_tool_calls 1: one call asked for
    assert [o.name for o in named.output] == ["time"]

    plain = oai.responses.create(model="up/m", input="x", tools=FN_TOOLS, tool_choice="none", parallel_tool_calls=False)
    assert gateway.seen[-1]["tool_choice"] == "none" and gateway.seen[-1]["parallel_tool_calls"] is False
    assert plain.output_text == "plain" and [o.type for o in plain.output] == ["message"]


def test_responses_input_items_become_tool_calls_and_tool_messages(oai, gateway):
    call = {"type": "function_call", "call_id": "call_7", "name": "weather", "arguments": '{"city": "Oslo"}'}
    out = {"type": "function_call_output", "call_id": "call_7", "output": "-3 C"}
    oai.responses.create(
        model="up/m",
        instructions="Be brief.",
        input=[{"role": "user", "content": "Weather in Oslo?"}, call, out],
        tools=FN_TOOLS,
    )
    assert gateway.seen[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "-3 C"},
    ]


def test_responses_previous_response_id_replays_the_calls(oai, gateway):
    first = oai.responses.create(model="up/m", input="Weather?", tools=FN_TOOLS, tool_choice="required", store=True)
    calls = [o for o in first.output if o.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {c.name}"} for c in calls]
    second = oai.responses.create(
        model="up/m", input=outputs, previous_response_id=first.id, tools=FN_TOOLS, tool_choice="none"
    )
    sent = gateway.seen[-1]["messages"]
    assert sent[0] == {"role": "user", "content": "Weather?"}
    assert sent[1]["role"] == "assistant" and [c["id"] for c in sent[1]["tool_calls"]] == [c.call_id for c in calls]
    assert [c["function"]["arguments"] for c in sent[1]["tool_calls"]] == [c.arguments for c in calls]
    assert sent[2:] == [{"role": "tool", "tool_call_id": c.call_id, "content": f"result {c.name}"} for c in calls]
    assert second.output_text == "plain"


def test_responses_stream_with_tool_calls(oai):
    with oai.responses.stream(model="up/m", input="Weather?", tools=FN_TOOLS, tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    per_call = ["response.output_item.added"] + ["response.function_call_arguments.delta"] * 3
    per_call += ["response.function_call_arguments.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress", *per_call, *per_call, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments, d.output_index) for d in done] == [
        ("weather", ARGS["weather"], 0),
        ("time", ARGS["time"], 1),
    ]
    assert [(o.type, o.name, o.arguments) for o in final.output] == [
        ("function_call", "weather", ARGS["weather"]),
        ("function_call", "time", ARGS["time"]),
    ]
    # strict tools: the SDK parses the arguments of the final response
    assert final.output[0].parsed_arguments == json.loads(ARGS["weather"])
    assert final.status == "completed" and final.usage.output_tokens == 7


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "built-in"),
        ({"tools": [{"type": "function", "name": "bad name", "parameters": {}}]}, "tools[0].name", "pattern"),
        ({"tools": FN_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "not served"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}], "tools": FN_TOOLS},
            "input[0].call_id",
            "call_x",
        ),
    ],
)
def test_responses_tool_errors_name_the_field(oai, kw, param, words):
    kw = {"input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="up/m", **kw)
    assert e.value.body["param"] == param and words in e.value.body["message"]


# ---------------------------------------------------------------- Messages
CLIENT_TOOLS = [
    {"name": "weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "time", "input_schema": TIME},
]
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def test_messages_tools_go_out_as_chat_tools_and_come_back_as_tool_use(claude, gateway):
    msg = claude.messages.create(
        model="up/m", max_tokens=32, messages=USER, tools=CLIENT_TOOLS, tool_choice={"type": "any"}
    )
    sent = gateway.seen[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": WEATHER, "description": "Weather in a city"},
        },
        {"type": "function", "function": {"name": "time", "parameters": TIME}},
    ]
    assert sent["tool_choice"] == "required" and "parallel_tool_calls" not in sent
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use", "tool_use"]
    for block, name in zip(msg.content, ("weather", "time")):
        assert block.id.startswith("toolu_") and block.name == name and block.input == json.loads(ARGS[name])
    assert msg.usage.input_tokens == 11 and msg.usage.output_tokens == 7

    one = claude.messages.create(
        model="up/m",
        max_tokens=32,
        messages=USER,
        tools=CLIENT_TOOLS,
        tool_choice={"type": "tool", "name": "time", "disable_parallel_tool_use": True},
    )
    assert gateway.seen[-1]["tool_choice"] == {"type": "function", "function": {"name": "time"}}
    assert gateway.seen[-1]["parallel_tool_calls"] is False
    assert [(b.type, b.name) for b in one.content] == [("tool_use", "time")]

    plain = claude.messages.create(
        model="up/m", max_tokens=8, messages=USER, tools=CLIENT_TOOLS, tool_choice={"type": "none"}
    )
    assert gateway.seen[-1]["tool_choice"] == "none"
    assert plain.stop_reason == "end_turn" and plain.content[0].text == "plain"


def test_messages_tool_result_round_trip(claude, gateway):
    first = claude.messages.create(model="up/m", max_tokens=32, messages=USER, tools=CLIENT_TOOLS)
    results = [
        {"type": "tool_result", "tool_use_id": first.content[0].id, "content": "18 C"},
        {
            "type": "tool_result",
            "tool_use_id": first.content[1].id,
            "content": [{"type": "text", "text": "no"}],
            "is_error": True,
        },
        {"type": "text", "text": "Thanks."},
    ]
    convo = [*USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    second = claude.messages.create(
        model="up/m",
        max_tokens=32,
        messages=convo,
        tools=CLIENT_TOOLS,
        tool_choice={"type": "none"},
        system="Be brief.",
    )
    assert second.content[0].text == "plain"
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in first.content
    ]
    assert gateway.seen[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": first.content[0].id, "content": "18 C"},
        {"role": "tool", "tool_call_id": first.content[1].id, "content": "Error: no"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]


def test_messages_stream_with_tool_use(claude):
    with claude.messages.stream(model="up/m", max_tokens=32, messages=USER, tools=CLIENT_TOOLS) as stream:
        events = [e for e in stream if e.type not in ("input_json", "text")]  # the SDK's own derived events
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    per_block = [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
    ]
    assert kinds == ["message_start", *per_block, *per_block, "message_delta", "message_stop"]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "weather", {}), ("tool_use", "time", {})]
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "weather", json.loads(ARGS["weather"])),
        ("tool_use", "time", json.loads(ARGS["time"])),
    ]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 7


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": CLIENT_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"tool_choice": {"type": "any"}}, "needs at least one tool"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}
                ],
                "tools": CLIENT_TOOLS,
            },
            "toolu_x",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "toolu_1", "name": "time", "input": {}}],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
                ]
            },
            "must define tools",
        ),
    ],
)
def test_messages_tool_errors_in_anthropic_envelope(claude, kw, words):
    kw = {"messages": USER, **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="up/m", max_tokens=8, **kw)
    err = e.value.body["error"]
    assert e.value.body["type"] == "error" and err["type"] == "invalid_request_error" and words in err["message"]
