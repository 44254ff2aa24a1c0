"""Tool calling on /v1/chat/completions against a live `headwise serve` (SmolLM2, whose template has
no tool format: our preamble and the Hermes `<tool_call>` format), through the official openai
client: tool_choice auto / required / named, parallel_tool_calls, streamed tool_calls deltas, a
`role: "tool"` result fed back, `parse` with `openai.pydantic_function_tool`; every call's arguments
validate with `jsonschema` against its tool's parameters; bad tool input is a 400 naming the field.
Templates that render tools themselves (Qwen 2.5, Llama 3.1) are held to transformers'
apply_chat_template; the auto grammar to llguidance's own matcher."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from headwise.runtime.grammar import llg_tokenizer
from headwise.runtime.tool_grammar import HERMES, LLAMA3, tool_grammar
from headwise.serve.openai import chat
from headwise.serve.openai.tool_calls import CallParser, delta_chunks
from headwise.serve.schemas import ChatCompletionRequest

from .conftest import auth

FIXTURES = Path(__file__).parents[1] / "fixtures"


def fn(name: str, description: str, parameters: dict | None) -> dict:
    f = {"name": name, "description": description}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


WEATHER = fn(
    "get_weather",
    "Current weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
)
TOOLS = [
    WEATHER,
    fn(  # numbers with ranges, an array with bounds
        "book_table",
        "Book a restaurant table",
        {
            "type": "object",
            "properties": {
                "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                "hour": {"type": "number", "minimum": 11, "maximum": 23},
                "dishes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
            },
            "required": ["guests", "hour", "dishes"],
        },
    ),
    fn(  # a nested object, nullable and optional fields
        "create_contact",
        "Save a contact",
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 16}, "email": {"type": ["string", "null"]}},
                    "required": ["name", "email"],
                },
                "note": {"type": "string", "maxLength": 16},
            },
            "required": ["person"],
        },
    ),
    fn(  # anyOf and $ref
        "set_alarm",
        "Set an alarm",
        {
            "type": "object",
            "$defs": {"time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
            "properties": {
                "at": {"$ref": "#/$defs/time"},
                "repeat": {"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["daily", "weekly"]}]},
            },
            "required": ["at", "repeat"],
        },
    ),
    fn("get_time", "The current time", None),  # no parameters: {} only
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0}) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call) -> dict:
    """A call's arguments parse and validate against its tool's schema (jsonschema); -> the arguments."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return args


NAMED = ["book_table", "create_contact", "set_alarm", "get_time"]  # get_weather: the next test


def test_named_tool_calls_validate_for_each_schema(aclient):
    async def one(client, name):
        return await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Use {name} for my request: Paris, tonight, two people."}],
            tools=[WEATHER, next(t for t in TOOLS if t["function"]["name"] == name)],  # a short prompt
            tool_choice={"type": "function", "function": {"name": name}},
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=0,
        )

    async def run():
        async with aclient() as client:
            return await asyncio.gather(*(one(client, n) for n in NAMED))

    for name, res in zip(NAMED, asyncio.run(run())):
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls", (name, choice)
        assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name == name
        check_call(choice.message.tool_calls[0])
        assert choice.message.content is None


def test_required_picks_a_tool_and_parallel_false_gives_one_call(client):
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER, TOOLS[-1]], tool_choice="required", max_tokens=40)
    res = client.chat.completions.create(**kw, parallel_tool_calls=False, temperature=0)
    calls = res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and check_call(calls[0])["city"] == "Paris"
    # streamed, the client's own stream helper assembles the same call from the deltas
    with client.chat.completions.stream(**kw, parallel_tool_calls=False, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content is None
    got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in calls]


def test_auto_answers_in_text_as_plain_decoding_would(client):
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS[:2], max_tokens=12, temperature=0)
    res = client.chat.completions.create(**kw)  # tool_choice defaults to auto
    msg = res.choices[0].message
    assert msg.tool_calls is None and res.choices[0].finish_reason == "length"
    plain = client.chat.completions.create(**kw, tool_choice="none")  # the same prompt, no grammar
    assert msg.content == plain.choices[0].message.content  # the lazy grammar never touched free text


def grammar_accepts(smol, lark: str):
    """text -> whether llguidance's own matcher over this Lark grammar takes all of it and may end there."""
    import llguidance

    lt = llg_tokenizer(smol.tokenizer, smol.config.vocab_size)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        ok = m.consume_tokens(smol.tokenizer.encode(text, add_special_tokens=False))
        return ok and not m.is_error() and m.is_accepting()

    return accepts


def test_auto_grammar_constrains_a_call_once_it_starts(smol):
    """llguidance's own matcher over the auto grammar: text, then a call that must match its schema."""
    accepts = grammar_accepts(
        smol, tool_grammar(HERMES, [("get_weather", PARAMS["get_weather"])], choice="auto", parallel=False)
    )

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}\n</tool_call>'
    assert accepts("Just text, no call.") and accepts(call) and accepts("Let me look. " + call)
    assert not accepts(call.replace('"c"', '"kelvin"'))  # outside the enum
    assert not accepts(call.replace("get_weather", "get_wether"))  # no such tool
    assert not accepts(call + "\n" + call)  # parallel_tool_calls false: one call
    parser = CallParser(HERMES)
    parser.feed("Let me look. " + call, final=True)
    message, reason = parser.message("stop")
    assert reason == "tool_calls" and message["content"] == "Let me look. "
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_llama3_auto_is_a_call_or_text_that_is_not_one(smol):
    """Llama 3.x calls are bare JSON: the answer is one call (its template allows one) or text."""
    accepts = grammar_accepts(
        smol, tool_grammar(LLAMA3, [("get_weather", PARAMS["get_weather"])], choice="auto", parallel=True)
    )

    call = '{"name": "get_weather", "parameters": {"city":"Paris","unit":"f"}}'
    assert accepts(call) and accepts("It is sunny.") and accepts("")
    assert not accepts(call + call) and not accepts('{"name": "get_weather", "parameters": {"city":"Paris"}}')


def test_auto_with_a_response_format_is_that_schema_or_calls(smol, main):
    """The OpenAI Agents SDK sends an output schema and tools: the answer is the object or a call."""
    from headwise.serve.openai.tools import text_grammar_of
    from headwise.serve.schemas import ResponseFormat

    answer = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"]}
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
    lark = tool_grammar(HERMES, [("get_weather", PARAMS["get_weather"])], choice="auto", parallel=False,
                        text=text_grammar_of(fmt))  # fmt: skip
    accepts = grammar_accepts(smol, lark)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}\n</tool_call>'
    assert accepts('{"temp":21}') and accepts(call)
    assert not accepts("It is warm.") and not accepts('{"temp":"warm"}')
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER], "max_tokens": 4,
            "response_format": {"type": "regex", "pattern": "[a-z]+"}}  # fmt: skip
    r = httpx.post(main.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_calls_read_back_one_character_at_a_time(fmt):
    """Streamed a character at a time, the deltas join into the calls json reads from the text."""
    args = ['{"city":"Pa}ris","n":[1,{"x":"}"}]}', "{}"]
    calls = [f"{fmt.open}f{k}{fmt.mid}{a}{fmt.close}" for k, a in enumerate(args if fmt.parallel else args[:1])]
    text = ("Let me check. " if fmt.anywhere else "") + fmt.sep.join(calls)
    parser, chunks = CallParser(fmt), []
    for k, ch in enumerate(text):
        chunks += delta_chunks(parser, ch, "stop" if k == len(text) - 1 else None)
    content = "".join(d.get("content", "") for d, _ in chunks)
    got: dict[int, list] = {}
    for d, _ in chunks:
        for tc in d.get("tool_calls", ()):
            got.setdefault(tc["index"], [tc["function"].get("name"), ""])[1] += tc["function"]["arguments"]
    assert content == ("Let me check. " if fmt.anywhere else "") and chunks[-1][1] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in got.values()] == [(f"f{k}", json.loads(a)) for k, a in enumerate(args)][
        : len(calls)
    ]
    plain = CallParser(fmt)  # text that is no call stays content, even when it starts like one
    assert "".join(d.get("content", "") for d, _ in delta_chunks(plain, "<tool_ca{not a call", "stop")) == (
        "<tool_ca{not a call"
    )


def test_streamed_parallel_calls_arrive_as_openai_deltas(client):
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=56, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    firsts = {}
    for d in deltas:
        if d.index not in firsts:  # OpenAI's shape: the first delta of a call names it, arguments ""
            assert d.id.startswith("call_") and d.type == "function" and d.function.name and d.function.arguments == ""
            firsts[d.index] = d
        else:
            assert d.id is None and d.function.name is None and d.function.arguments
    args = {i: "".join(d.function.arguments for d in deltas if d.index == i) for i in firsts}
    want = whole.choices[0].message.tool_calls
    # parallel_tool_calls (the default): SmolLM2 calls again and again until max_tokens
    assert len(want) >= 2 and len({c.id for c in want}) == len(want)
    assert [(firsts[i].function.name, args[i]) for i in sorted(firsts)] == [
        (c.function.name, c.function.arguments) for c in want
    ]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    for c in want if whole.choices[0].finish_reason == "tool_calls" else want[:-1]:  # the last may be cut
        check_call(c)


def test_streamed_calls_of_two_choices(client):
    """n = 2 (not the engine thread's direct stream): each choice's deltas assemble its own call."""
    chunks = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, n=2,
        max_tokens=40, temperature=0.8, seed=7, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    calls, reasons = {}, {}
    for c in chunks:
        for ch in c.choices:
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
            for d in ch.delta.tool_calls or ():
                entry = calls.setdefault((ch.index, d.index), {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments
    assert sorted(calls) == [(0, 0), (1, 0)] and reasons == {0: "tool_calls", 1: "tool_calls"}
    for entry in calls.values():
        assert entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS["get_weather"])
    assert c.usage is not None and c.usage.completion_tokens > 0  # the last chunk: usage


def test_tool_results_are_fed_back_and_answered(client):
    def answer(result: str) -> str:
        call = {
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
        }
        res = client.chat.completions.create(
            model="smollm2",
            messages=[
                {"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": result},
            ],
            tools=TOOLS[:1],
            max_tokens=24,
            temperature=0,
        )
        assert res.choices[0].message.tool_calls is None and res.choices[0].finish_reason in ("stop", "length")
        return res.choices[0].message.content

    sunny, snow = answer("It is 18 C and sunny in Rome."), answer("It is -5 C with heavy snow in Rome.")
    assert "18 C" in sunny and "heavy snow" in snow  # the model read each result


class Reservation(BaseModel):
    """Book a table."""

    guests: int = Field(ge=1, le=8)
    name: str = Field(max_length=12)


def test_parse_with_pydantic_function_tool(client):
    messages = [{"role": "user", "content": "Book a table for 4 people under the name Ada."}]
    tools = [openai.pydantic_function_tool(Reservation)]
    res = client.chat.completions.parse(
        model="smollm2",
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    call = res.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Reservation)
    assert call.function.parsed_arguments == Reservation.model_validate_json(call.function.arguments)
    # the parsed message goes back as it is (agents append it to the conversation), then the result
    convo = [*messages, res.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "Booked."}]
    again = client.chat.completions.create(model="smollm2", messages=convo, tools=tools, max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [fn("f", "", {"type": "string"})]}, "tools", "object"),
        (
            {"tools": [fn("f", "", {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})]},
            "tools",
            "uniqueItems",
        ),  # fmt: skip
        ({"tools": [fn("bad name!", "", None)]}, "tools", "pattern"),
        ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id", "tool_call_id"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "1", "tool_call_id": "call_x"}]},
            "messages[1].tool_call_id",
            "call_x",
        ),  # fmt: skip
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(main, change, param, words):
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **change}
    r = httpx.post(main.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and words in err["message"], err


# ---------------------------------------------------------------- templates with a tool format
HF_MESSAGES = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
        ],
    },
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C in Paris."},
    {"role": "user", "content": "And Rome?"},
]


def openai_messages(hf_messages: list[dict]) -> list[dict]:
    """The same conversation as an OpenAI client sends it (ids, arguments as JSON text)."""
    out = []
    for m in hf_messages:
        if "tool_calls" in m:
            calls = [
                {"id": f"call_{k}", "type": "function", "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for k, c in enumerate(m["tool_calls"])
            ]  # fmt: skip
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
        elif m["role"] == "tool":
            out.append({**m, "tool_call_id": "call_0"})
        else:
            out.append(m)
    return out


@pytest.mark.parametrize("family, template", [("qwen2", "qwen2.5-instruct"), ("llama", "llama3.1-instruct")])
def test_tool_template_renders_as_transformers(family, template):
    import transformers

    from headwise.models.tokenizer import Tokenizer

    text = (FIXTURES / "templates" / f"{template}.jinja").read_text()
    hf = transformers.AutoTokenizer.from_pretrained(FIXTURES / "families" / family)
    ours = Tokenizer.from_dir(FIXTURES / "families" / family)
    ours.chat_template = text
    want = hf.apply_chat_template(
        HF_MESSAGES, tools=TOOLS[:2], chat_template=text, tokenize=False, add_generation_prompt=True
    )
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": openai_messages(HF_MESSAGES), "tools": TOOLS[:2]}
    )
    assert chat.render_prompt(ours, req) == hf(want, add_special_tokens=False)["input_ids"]
    assert chat.plan(ours, req).native and chat.plan(ours, req).fmt.name == (
        "hermes" if family == "qwen2" else "llama3"
    )


def test_special_token_markers_are_matched_as_tokens(tmp_path):
    """A tokenizer whose <tool_call> / </tool_call> are special tokens: the grammar takes the tokens
    (the model's own way to call), not the same characters spelled out."""
    import llguidance
    import transformers

    from headwise.models.tokenizer import Tokenizer
    from headwise.runtime.grammar import llg_tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(FIXTURES / "families" / "qwen2")
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    special = frozenset(["<tool_call>", "</tool_call>"])
    assert all(tok.token_to_id(t) in tok.special_token_ids for t in special)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    as_tokens = tok.encode(call, add_special_tokens=False)
    spelled = [i for ch in call for i in tok.encode(ch, add_special_tokens=False)]  # no special token in it
    assert tok.token_to_id("<tool_call>") in as_tokens and tok.token_to_id("<tool_call>") not in spelled
    for choice in ("required", "auto"):
        lark = tool_grammar(HERMES, [("get_time", None)], choice=choice, parallel=False, special=special)
        lt = llg_tokenizer(tok, None)

        def accepts(ids):
            m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
            return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()

        assert accepts(as_tokens) and not accepts(spelled[:-1] + as_tokens[-1:])
        parser = CallParser(HERMES)
        parser.feed(tok.decode(as_tokens), final=True)
        assert parser.message("stop")[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_function_named_like_a_choice_is_still_a_named_choice(smol):
    tools = [fn("auto", "", None), fn("none", "", None)]
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": ASK,
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "none"}},
        }
    )
    p = chat.plan(smol.tokenizer, req)
    assert (p.choice, p.named, p.calls) == ("required", "none", True)
