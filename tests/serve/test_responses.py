"""/v1/responses through the official openai client against a live `headwise serve`; each answer
checked against the same messages sent to /v1/chat/completions by the same client at temperature 0."""

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import schemathesis
from pydantic import BaseModel
from schemathesis.specs.openapi.checks import positive_data_acceptance

from headwise.serve.openai import response_store

from .conftest import ServeProcess, auth, metrics_values
from .fuzzing import FUZZ_SETTINGS, openapi_schema
from .test_disconnect import engine_gauge, wait_idle

CHAT = [{"role": "user", "content": "Name three colors."}]


def chat_text(client, messages, model="smollm2", max_tokens=24):
    res = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return res.choices[0].message.content, res.choices[0].finish_reason, res.usage


def test_create_equals_chat(client):
    ref, reason, usage = chat_text(client, CHAT)
    res = client.responses.create(model="smollm2", input="Name three colors.", max_output_tokens=24, temperature=0)
    assert res.output_text == ref
    assert res.object == "response" and res.id.startswith("resp_") and res.model == "smollm2"
    assert res.status == ("completed" if reason == "stop" else "incomplete")
    (item,) = res.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [c.type for c in item.content] == ["output_text"] and item.content[0].annotations == []
    assert res.usage.input_tokens == usage.prompt_tokens and res.usage.output_tokens == usage.completion_tokens
    assert res.usage.total_tokens == usage.total_tokens
    # the same as a list of messages with input_text parts
    listed = client.responses.create(
        model="smollm2",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
        max_output_tokens=24,
        temperature=0,
    )
    assert listed.output_text == ref


def test_instructions_are_the_system_message(client):
    system = "You answer in French."
    ref, _, _ = chat_text(client, [{"role": "system", "content": system}, *CHAT])
    plain, _, _ = chat_text(client, CHAT)
    res = client.responses.create(model="smollm2", instructions=system, input=CHAT, max_output_tokens=24, temperature=0)
    assert res.output_text == ref and ref != plain
    assert res.instructions == system


def test_text_format_takes_chats_response_format_path(client):
    """text.format json_schema is chat's response_format json_schema: the same answer, or the same refusal."""
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    msgs = [{"role": "user", "content": "Give a color as JSON."}]
    plain = client.responses.create(
        model="smollm2", input=msgs, text={"format": {"type": "text"}}, max_output_tokens=12, temperature=0
    )
    assert plain.output_text == chat_text(client, msgs, max_tokens=12)[0]

    def chat():
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
        res = client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=24, temperature=0, response_format=fmt
        )
        return res.choices[0].message.content

    def responses():
        fmt = {"type": "json_schema", "name": "c", "schema": schema, "strict": True}
        res = client.responses.create(
            model="smollm2", input=msgs, max_output_tokens=24, temperature=0, text={"format": fmt}
        )
        return res.output_text

    try:
        ref = chat()
    except openai.BadRequestError as e:
        with pytest.raises(openai.BadRequestError) as got:
            responses()
        assert got.value.body["message"] == e.body["message"] and got.value.body["param"] == "text.format"
    else:
        assert responses() == ref


class Pet(BaseModel):
    name: str
    kind: Literal["cat", "dog", "bird"]
    age: int


def test_parse_with_a_pydantic_model(client):
    """openai's responses.parse(text_format=Model): the schema reaches chat's grammar; the answer is the
    object chat.completions.parse(response_format=Model) gives for the same messages."""
    msgs = [{"role": "user", "content": "Describe a pet as JSON."}]
    res = client.responses.parse(model="smollm2", input=msgs, text_format=Pet, max_output_tokens=60, temperature=0)
    assert res.status == "completed" and isinstance(res.output_parsed, Pet)
    jsonschema.validate(json.loads(res.output_text), Pet.model_json_schema())
    ref = client.chat.completions.parse(
        model="smollm2", messages=msgs, max_tokens=60, temperature=0, response_format=Pet
    )
    assert res.output_parsed == ref.choices[0].message.parsed
    assert res.output_text == ref.choices[0].message.content
    # streamed: the deltas make the same text, and the stream helper parses it
    with client.responses.stream(
        model="smollm2", input=msgs, text_format=Pet, max_output_tokens=60, temperature=0
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == res.output_text and final.output_parsed == res.output_parsed
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="smollm2", input=msgs, text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}
        )
    assert e.value.body["param"] == "text.format"


def test_max_output_tokens_is_incomplete(client):
    res = client.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=5, temperature=0)
    assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    assert res.usage.output_tokens == 5
    assert res.output_text == chat_text(client, [{"role": "user", "content": "Tell me a long story."}], max_tokens=5)[0]


def test_stream_events_in_order(client):
    whole = client.responses.create(model="smollm2", input=CHAT, max_output_tokens=24, temperature=0)
    with client.responses.stream(model="smollm2", input=CHAT, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text == events[-4].text
    assert final.status == whole.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.output[0].content[0].text == whole.output[0].content[0].text


def test_stream_create_true_incomplete(client):
    events = list(client.responses.create(model="smollm2", input=CHAT, max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == chat_text(client, CHAT, max_tokens=3)[0]


def test_store_and_previous_response_id(client):
    first = client.responses.create(model="smollm2", input=CHAT, max_output_tokens=16, temperature=0, store=True)
    follow = "And three more?"
    second = client.responses.create(
        model="smollm2", input=follow, previous_response_id=first.id, max_output_tokens=16, temperature=0, store=True
    )
    convo = [*CHAT, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow}]
    ref, _, usage = chat_text(client, convo, max_tokens=16)
    assert second.output_text == ref and second.previous_response_id == first.id
    assert second.usage.input_tokens == usage.prompt_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # a third turn chains through the second
    third = client.responses.create(
        model="smollm2", input="Thanks.", previous_response_id=second.id, max_output_tokens=8, temperature=0
    )
    convo += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]
    assert third.output_text == chat_text(client, convo, max_tokens=8)[0]
    # stateless by default: the third was not stored
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def counted(url: str, model: str, endpoint: str) -> float:
    """Requests the server at url answered 200 for `model` on `endpoint` (its own counter)."""
    want = {"model": model, "endpoint": endpoint, "status": "200"}
    return sum(v for labels, v in metrics_values(url, "headwise_requests_total").items() if dict(labels) == want)


def test_a_streamed_response_is_stored_too(client):
    with client.responses.stream(model="smollm2", input=CHAT, max_output_tokens=12, temperature=0, store=True) as s:
        first = s.get_final_response()
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(
        model="smollm2", input="Why?", previous_response_id=first.id, max_output_tokens=12, temperature=0
    )
    convo = [*CHAT, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Why?"}]
    assert follow.output_text == chat_text(client, convo, max_tokens=12)[0]


def test_through_the_gateway_to_an_upstream(client, main, peer):
    """peer/tiny is a provider: the gateway sends it an ordinary chat completion request."""
    ref, _, _ = chat_text(client, CHAT, model="peer/tiny", max_tokens=8)
    before = counted(peer.url, "tiny", "chat"), counted(main.url, "peer/tiny", "responses")
    res = client.responses.create(model="peer/tiny", input=CHAT, max_output_tokens=8, temperature=0)
    assert res.output_text == ref
    assert (counted(peer.url, "tiny", "chat"), counted(main.url, "peer/tiny", "responses")) == (
        before[0] + 1,
        before[1] + 1,
    )
    with client.responses.stream(model="peer/tiny", input=CHAT, max_output_tokens=8, temperature=0) as stream:
        last = list(stream)[-1]  # a random tiny model: 8 tokens end it, response.incomplete as OpenAI sends
    assert last.type == "response." + res.status and last.response.output_text == ref


def test_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="smollm2", input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input=42)
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's built-in tools run on OpenAI's servers
        client.responses.create(model="smollm2", input="Hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type" and "'web_search'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input="Hi", text={"format": {"type": "yaml"}})
    assert e.value.body["param"] == "text.format"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="smollm2", input=[{"role": "user", "content": [{"type": "input_image"}]}])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    # chat's context check, in the Responses API's field names ("tiny" holds 96 tokens)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="word " * 200)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", max_output_tokens=500)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_output_tokens"


@pytest.fixture(scope="module")
def small_store(tiny_dir, servers_dir):
    server = ServeProcess(
        {"server": {"api_key_env": ""}, "models": {"tiny": {"source": str(tiny_dir)}}},
        servers_dir,
        "responses-store",
        env={"HEADWISE_RESPONSES_STORE_MAX": "2"},
    )
    yield server.wait_ready()
    server.stop()


def test_bounded_store_evicts_least_recently_used(small_store):
    client = openai.OpenAI(base_url=small_store.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def make():
        return client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=True).id

    a, b = make(), make()
    client.responses.retrieve(a)  # a is now the most recently used: b goes first
    c = make()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b)
    assert {client.responses.retrieve(x).id for x in (a, c)} == {a, c}
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="Hi", previous_response_id=b)
    assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"


def test_stream_disconnect_aborts_the_engine_request(main):
    aborted = engine_gauge(main.url, "requests_aborted")
    body = {"model": "smollm2", "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", main.url + "/v1/responses", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: dropping it would close the connection already
            deltas = 0
            while deltas < 3:
                deltas += next(lines) == "event: response.output_text.delta"
            assert engine_gauge(main.url, "running") == 1
        # leaving the block closes the connection mid-stream
    wait_idle(main.url)
    assert engine_gauge(main.url, "requests_aborted") == aborted + 1


def test_store_expires_by_age(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = response_store.ResponseStore(max_items=10, max_age=60)
    store.put("a", {"id": "a"}, [])
    now[0] += 30
    store.put("b", {"id": "b"}, [])
    now[0] += 31  # a is 61 s old, b 31 s
    assert store.get("a") is None and store.get("b").response == {"id": "b"} and len(store) == 1
    with pytest.raises(ValueError, match="max_items >= 0"):
        response_store.ResponseStore(max_items=-1)


# schemathesis over /v1/responses (and GET / DELETE of a stored one): valid and invalid bodies, no 5xx,
# every answer as the schema says; valid bodies go to the random tiny Llama so they reach the handler
fuzzed = schemathesis.pytest.from_fixture("responses_schema").include(path_regex=r"^/v1/responses")


@pytest.fixture
def responses_schema(main):
    return openapi_schema(main.url)


@fuzzed.parametrize()
@FUZZ_SETTINGS
def test_fuzzed_requests_get_no_server_error(case):
    if case.meta.generation.mode.is_positive and isinstance(case.body, dict):
        case.body["model"] = "tiny"
        case.body.pop("previous_response_id", None)  # a random id is a 404 by design
    case.call_and_validate(headers=auth(), excluded_checks=[positive_data_acceptance], timeout=60)
