"""The gateway validates only what it serves (issue 41): requests routed to an upstream provider reach
it as the client sent them (`model` renamed), whatever fields they carry; a local model still gets our
strict schema's 400s; /v1/messages goes straight to an upstream that speaks Anthropic's API.

The upstream is a fake in this process that records every request (path, headers, body bytes) and
answers a canned OpenAI or Anthropic response; the clients are the official `openai` and `anthropic`
SDKs, so "what the client sent" is what those SDKs put on the wire, not what our code thinks."""

import json
import secrets

import anthropic
import httpx
import jsonschema
import openai
import pytest

from headwise.serve import create_app, parse_config

from .conftest import LOG, LiveServer, auth

GW_KEY = "sk-gw-" + secrets.token_hex(12)  # the clients' key for the gateway: never forwarded
OAI_KEY, OAI_ENV = "sk-rec-" + secrets.token_hex(12), "HEADWISE_TEST_REC_KEY"
ANT_KEY, ANT_ENV = "sk-ant-" + secrets.token_hex(12), "HEADWISE_TEST_ANT_KEY"
MSG = [{"role": "user", "content": "Hi"}]
TEXT = "canned answer"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


# ---------------------------------------------------------------- the recording upstream
def _chat_answer():
    return {
        "id": "chatcmpl-canned",
        "object": "chat.completion",
        "created": 1,
        "model": "upstream-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": TEXT}, "finish_reason": "stop", "logprobs": None}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def _chat_stream():
    for i, piece in enumerate(("canned ", "answer")):
        chunk = {
            "id": "chatcmpl-canned",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "upstream-model",
            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if i else None}],
        }
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _message(model):
    return {
        "id": "msg_canned",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": TEXT}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }


def _sse(name, data):
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _message_stream(model, broken=None):
    start = {**_message(model), "content": [], "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    yield _sse("message_start", {"type": "message_start", "message": start})
    block = {"type": "text", "text": ""}
    yield _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
    yield _sse("ping", {"type": "ping"})
    for piece in ("canned ", "answer"):
        yield _sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
        )
        if broken == "errevent":  # the upstream's error event, our key echoed in it
            error = {"type": "overloaded_error", "message": f"died; you sent {ANT_KEY}"}
            yield _sse("error", {"type": "error", "error": error})
            return
        if broken == "truncated":
            return
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    delta = {"stop_reason": "end_turn", "stop_sequence": None}
    yield _sse("message_delta", {"type": "message_delta", "delta": delta, "usage": {"output_tokens": 2}})
    yield _sse("message_stop", {"type": "message_stop"})


def _recorder_app(seen: list):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def handle(request):
        raw = await request.body()
        body = json.loads(raw)
        seen.append({"path": request.url.path, "headers": dict(request.headers), "raw": raw, "body": body})
        model, stream = body.get("model"), body.get("stream")
        if request.url.path.endswith("/chat/completions"):
            if stream:
                return StreamingResponse(_chat_stream(), media_type="text/event-stream")
            return JSONResponse(_chat_answer())
        echo = json.dumps(dict(request.headers))  # x-api-key included: must never reach anyone
        if request.url.path.endswith("/count_tokens"):
            return JSONResponse({"input_tokens": 11 + len(json.dumps(body["messages"]))})
        if model == "overloaded":
            error = {"type": "overloaded_error", "message": f"busy; you sent {echo}"}
            return JSONResponse({"type": "error", "error": error}, status_code=529)
        if model == "picky":
            error = {"type": "invalid_request_error", "message": f"bad field; you sent {echo}"}
            return JSONResponse({"type": "error", "error": error}, status_code=400)
        if model == "badshape":
            return JSONResponse({"choices": []})  # an OpenAI answer where a message was due
        if stream:
            broken = model if model in ("errevent", "truncated") else None
            return StreamingResponse(_message_stream(model, broken), media_type="text/event-stream")
        return JSONResponse(_message(model))

    async def health(request):  # LiveServer.start waits for it
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/{path:path}", handle, methods=["POST"]), Route("/health", health)])


@pytest.fixture(scope="module")
def seen():
    return []


@pytest.fixture(scope="module")
def gw(seen, tiny_dir):
    """A gateway with a local model (`tiny`), an OpenAI provider `rec` and an Anthropic one `claude`,
    both the recording fake; routes that put the local model before / after the upstream."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(OAI_ENV, OAI_KEY)
        mp.setenv(ANT_ENV, ANT_KEY)
        upstream = LiveServer(_recorder_app(seen)).start()
        config = {
            "server": {"api_keys": [GW_KEY], "api_key_env": ""},
            "models": {"tiny": {"source": str(tiny_dir), "max_model_len": 96}},
            "providers": {
                "rec": {"base_url": upstream.url + "/v1", "api_key_env": OAI_ENV, "models": ["gpt"], "timeout": 10},
                "claude": {
                    "base_url": upstream.url + "/v1",
                    "api": "anthropic",
                    "api_key_env": ANT_ENV,
                    "models": ["sonnet", "overloaded", "picky", "badshape", "errevent", "truncated"],
                    "timeout": 10,
                },
            },
            "routes": {
                "local-first": {"targets": ["tiny"], "fallbacks": ["rec/gpt"], "retries": 0},
                "upstream-first": {"targets": ["rec/gpt"], "fallbacks": ["tiny"], "retries": 0},
                "any": {"targets": ["claude/sonnet", "rec/gpt"], "retries": 0},
            },
        }
        server = LiveServer(create_app(parse_config(config))).start()
        yield server
        server.stop()
        upstream.stop()


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=GW_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=gw.url, api_key=GW_KEY, max_retries=0, timeout=60)


def last(seen, path):
    hit = seen[-1]
    assert hit["path"] == path
    return hit


def canonical(value) -> str:
    """JSON as typed: 1 and 1.0 differ, key order does not."""
    return json.dumps(value, sort_keys=True)


# fields headwise's local models do not serve (some not even OpenAI's yet): an upstream decides
UNSERVED = {
    "tools": [TOOL],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "canned answer"},
    "modalities": ["text"],
    "web_search_options": {"search_context_size": "low"},
    "n": 2,
    "logit_bias": {"50256": -100},
    "temperature": 1,  # an int: our schema's float would go out as 1.0
    "max_tokens": 5,
}
FUTURE = {"frobnicate_level": {"deep": [1, 2.5, None, "x"]}, "verbosity": "low"}


def test_every_field_reaches_an_openai_upstream_unchanged(oai, seen):
    res = oai.chat.completions.create(model="rec/gpt", messages=MSG, **UNSERVED, extra_body=FUTURE)
    assert res.id == "chatcmpl-canned" and res.choices[0].message.content == TEXT
    hit = last(seen, "/v1/chat/completions")
    sent = {"model": "gpt", "messages": MSG, **UNSERVED, **FUTURE}  # model: the provider's name for it
    assert canonical(hit["body"]) == canonical(sent)
    assert hit["headers"]["authorization"] == f"Bearer {OAI_KEY}"  # the configured key, not the client's
    assert GW_KEY not in json.dumps(hit["headers"])


def test_streams_and_named_tool_choice_reach_the_upstream(oai, seen):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = oai.chat.completions.create(
        model="rec/gpt", messages=MSG, tools=[TOOL], tool_choice=named, stream=True, max_tokens=5
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == TEXT
    body = last(seen, "/v1/chat/completions")["body"]
    assert body["tool_choice"] == named and body["stream"] is True and body["tools"] == [TOOL]


def test_a_local_model_keeps_the_strict_schema(oai, seen):
    before = len(seen)
    for field, value in [("frobnicate_level", 1), ("web_search_options", {}), ("reasoning_effort", "low")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "unknown field" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a mistake in a field we serve: named as before
        oai.chat.completions.create(model="tiny", messages=MSG, temperature=5)
    assert e.value.body["param"] == "temperature"
    assert oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices[0].finish_reason == "length"
    # a route tries its local target first: its 400 is the client's mistake, no fallback upstream
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="local-first", messages=MSG, max_tokens=2, extra_body=FUTURE)
    assert e.value.body["param"] == "frobnicate_level"
    assert len(seen) == before  # nothing went upstream
    # ... and the upstream first: it takes the request as it is
    res = oai.chat.completions.with_raw_response.create(
        model="upstream-first", messages=MSG, max_tokens=2, extra_body=FUTURE
    )
    assert res.headers["x-headwise-target"] == "rec/gpt" and res.parse().choices[0].message.content == TEXT
    assert last(seen, "/v1/chat/completions")["body"]["frobnicate_level"] == FUTURE["frobnicate_level"]


@pytest.mark.parametrize(
    "body, param, what",
    [
        (b"{not json", None, "not valid JSON"),
        (b"", None, "empty"),
        (b'{"model": "rec/gpt", "messages": [], "temperature": NaN}', None, "NaN is not a JSON number"),
        (b'{"messages": []}', "model", "Field required"),
        (b'{"model": "", "messages": []}', "model", "at least 1 character"),
        (b'{"model": "rec/gpt", "stream": "yes"}', "stream", "valid boolean"),
        (b'["rec/gpt"]', None, "valid dictionary"),
        (b'{"model": "rec/gpt", "x": ' + b"[" * 50_000, None, "nested too deeply"),
    ],
)
def test_what_the_gateway_itself_needs_is_checked(gw, seen, body, param, what):
    before = len(seen)
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers=auth(GW_KEY))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and what in error["message"], error
    assert len(seen) == before


def test_anthropic_upstream_gets_the_body_and_its_headers(claude, seen):
    extra = {"future_block": {"a": [1, 2.0]}}
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    kw = {
        "max_tokens": 7,
        "system": "Be brief.",
        "messages": MSG,
        "tools": tools,
        "tool_choice": {"type": "any"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u1"},
    }
    msg = claude.messages.create(model="claude/sonnet", **kw, extra_body=extra)
    assert msg.id == "msg_canned" and msg.content[0].text == TEXT and msg.stop_reason == "end_turn"
    hit = last(seen, "/v1/messages")
    assert canonical(hit["body"]) == canonical({"model": "sonnet", **kw, **extra})
    headers = hit["headers"]
    assert headers["x-api-key"] == ANT_KEY and "authorization" not in headers
    assert headers["anthropic-version"] == claude.default_headers["anthropic-version"]  # the SDK's, passed on
    assert GW_KEY not in json.dumps(headers)


def test_anthropic_stream_passes_through(claude, seen):
    with claude.messages.stream(model="claude/sonnet", max_tokens=5, messages=MSG) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT and final.content[0].text == TEXT and final.usage.output_tokens == 2
    assert last(seen, "/v1/messages")["body"]["stream"] is True


def test_count_tokens_goes_to_the_anthropic_upstream(claude, seen):
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    count = claude.messages.count_tokens(model="claude/sonnet", messages=messages, system="Be brief.")
    assert count.input_tokens == 11 + len(json.dumps(messages))  # the fake's count: it was asked
    hit = last(seen, "/v1/messages/count_tokens")
    assert hit["body"] == {"model": "sonnet", "messages": messages, "system": "Be brief."}
    assert hit["headers"]["x-api-key"] == ANT_KEY


def test_anthropic_version_defaults_and_passes_through(gw, seen):
    body = {"model": "claude/sonnet", "max_tokens": 3, "messages": MSG}
    for sent, expected in [({}, "2023-06-01"), ({"anthropic-version": "2099-01-01"}, "2099-01-01")]:
        r = httpx.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": GW_KEY, **sent})
        assert r.status_code == 200 and r.json()["content"][0]["text"] == TEXT
        assert last(seen, "/v1/messages")["headers"]["anthropic-version"] == expected


def test_anthropic_upstream_errors_are_ours(claude, gw):
    with pytest.raises(anthropic.InternalServerError) as e:  # 529 -> 503, retryable elsewhere
        claude.messages.create(model="claude/overloaded", max_tokens=3, messages=MSG)
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="claude/picky", max_tokens=3, messages=MSG)
    assert "claude/picky rejected the request (400)" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model="claude/badshape", max_tokens=3, messages=MSG)
    assert e.value.status_code == 502 and "not a message" in e.value.body["error"]["message"]
    for model, why in [("claude/errevent", "reported an error"), ("claude/truncated", "without event: message_stop")]:
        with httpx.stream(
            "POST",
            gw.url + "/v1/messages",
            json={"model": model, "max_tokens": 3, "messages": MSG, "stream": True},
            headers={"x-api-key": GW_KEY},
        ) as r:
            events = r.read().decode()
        assert r.status_code == 200 and events.count("event: content_block_delta") == 1
        assert events.rstrip().split("\n\n")[-1].startswith("event: error\ndata: ")
        error = json.loads(events.rstrip().split("\n\n")[-1].split("data: ", 1)[1])
        assert error["type"] == "error" and why in error["error"]["message"]
        assert ANT_KEY not in events
    for text in (str(e.value), LOG.getvalue()):
        assert ANT_KEY not in text and OAI_KEY not in text and GW_KEY not in text


def test_chat_to_an_anthropic_provider_is_a_400_naming_it(oai, seen):
    before = len(seen)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="claude/sonnet", messages=MSG, max_tokens=2)
    assert e.value.body["code"] == "unsupported_endpoint" and 'api = "anthropic"' in e.value.body["message"]
    assert len(seen) == before
    # a route that has an OpenAI target too draws only among those that serve chat
    for _ in range(4):
        res = oai.chat.completions.with_raw_response.create(model="any", messages=MSG, max_tokens=2)
        assert res.headers["x-headwise-target"] == "rec/gpt"


def test_openapi_still_documents_the_request_bodies(gw):
    doc = httpx.get(gw.url + "/openapi.json").json()
    for path, schema_name in [("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/messages", "MessagesRequest")]:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{schema_name}"
        validator = jsonschema.Draft202012Validator({"$ref": ref, "components": doc["components"]})
        assert validator.is_valid({"model": "tiny", "messages": MSG, "max_tokens": 2})
        assert not validator.is_valid({"model": "tiny", "messages": MSG, "max_tokens": "2"})
