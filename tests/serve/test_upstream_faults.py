"""Upstreams that answer 200 with something broken: the gateway checks what they send.

Non-streamed: not JSON, or JSON without `choices` / `data`, is a 502 before the first byte
(so the route's fallback still applies). Streamed: a malformed event, an upstream error
event, or an end without `data: [DONE]` becomes an error event, then `data: [DONE]`; a
stream broken before its first event is a 502 like a non-streamed one. Each fault counts
against the target for its cooldown, as a 5xx does. The fake upstream is in conftest.py.
"""

import json

import httpx
import openai
import pytest

from .conftest import FAKE_KEY, metrics_values


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(
        routes={
            "json-fallback": {"targets": ["fake/notjson"], "fallbacks": ["fake/ok"], "retries": 0},
            "stream-fallback": {"targets": ["fake/badfirst"], "fallbacks": ["fake/ok"], "retries": 0},
            "shape-cool": {
                "targets": ["fake/badshape"],
                "fallbacks": ["fake/ok"],
                "retries": 0,
                "cooldown_failures": 2,
                "cooldown_seconds": 600,
            },
            "stream-cool": {
                "targets": ["fake/truncated"],
                "fallbacks": ["fake/ok"],
                "retries": 0,
                "cooldown_failures": 2,
                "cooldown_seconds": 600,
            },
        }
    )


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def hits(fake_upstream, model: str) -> int:
    return httpx.get(fake_upstream.url + "/_hits").json().get(model, 0)


def events(gw, model: str, endpoint: str = "completions") -> tuple[int, list[str]]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 4,
        **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat/completions" else {"prompt": "hi"}),
    }
    with httpx.stream("POST", f"{gw.url}/v1/{endpoint}", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
        return r.status_code, lines


def test_a_proper_upstream_still_passes(client):
    assert client.completions.create(model="fake/ok", prompt="hi").choices[0].text == "hello there"
    chunks = list(
        client.chat.completions.create(model="fake/ok", messages=[{"role": "user", "content": "hi"}], stream=True)
    )
    assert "".join(c.choices[0].delta.content for c in chunks) == "hello"
    assert client.embeddings.create(model="fake/ok", input="hi").data[0].embedding == [0.6, 0.8]


def test_legal_but_awkward_sse_passes(gw, client):
    """CRLF line ends, a comment, events cut across reads, a last event without its blank line."""
    status, lines = events(gw, "fake/crlf")
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert [json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {")] == ["hel", "lo"]
    chunks = list(client.completions.create(model="fake/crlf", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hello"


@pytest.mark.parametrize("model", ["notjson", "badshape"])
@pytest.mark.parametrize("endpoint", ["completions", "chat", "embeddings"])
def test_a_non_json_or_misshapen_answer_is_502(client, model, endpoint):
    with pytest.raises(openai.APIStatusError) as e:
        if endpoint == "completions":
            client.completions.create(model=f"fake/{model}", prompt="hi")
        elif endpoint == "chat":
            client.chat.completions.create(model=f"fake/{model}", messages=[{"role": "user", "content": "hi"}])
        else:
            client.embeddings.create(model=f"fake/{model}", input="hi")
    assert e.value.status_code == 502
    assert e.value.body["code"] == "upstream_invalid_response"
    assert "fake/" + model in e.value.body["message"]
    assert "not json" not in e.value.body["message"]  # our words, not the upstream's


def test_a_broken_answer_falls_back(gw, fake_upstream):
    before = hits(fake_upstream, "notjson")
    r = httpx.post(gw.url + "/v1/completions", json={"model": "json-fallback", "prompt": "hi"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-headwise-target"] == "fake/ok" and r.json()["choices"][0]["text"] == "hello there"
    assert hits(fake_upstream, "notjson") == before + 1  # tried first, then the fallback


def test_a_stream_without_done_ends_with_an_error_event(gw, client):
    status, lines = events(gw, "fake/truncated")
    assert status == 200
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(x[6:]) for x in lines[:-1]]
    assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["hel", "lo"]
    error = payloads[-1]["error"]
    assert error["code"] == "upstream_truncated" and "[DONE]" in error["message"]
    # the official client raises on the error event instead of ending quietly
    seen = []
    with pytest.raises(openai.APIError):
        for c in client.chat.completions.create(
            model="fake/truncated", stream=True, messages=[{"role": "user", "content": "hi"}]
        ):
            seen.append(c.choices[0].delta.content)
    assert seen == ["hel", "lo"]


def test_a_malformed_event_ends_the_stream_with_an_error(gw):
    status, lines = events(gw, "fake/badevent", "chat/completions")
    assert status == 200 and lines[-1] == "data: [DONE]"
    payloads = [json.loads(x[6:]) for x in lines[:-1]]  # every event the client gets is JSON
    assert payloads[0]["choices"][0]["delta"]["content"] == "hel"
    assert payloads[1]["error"]["code"] == "upstream_invalid_response"
    assert len(payloads) == 2  # nothing after the bad event


def test_an_upstream_error_event_is_mapped(gw):
    status, lines = events(gw, "fake/errevent")
    assert status == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "engine_dead"  # a plain identifier: kept
    assert "fake/errevent" in error["message"] and "died" not in error["message"]
    assert FAKE_KEY not in "\n".join(lines)


@pytest.mark.parametrize("model", ["badfirst", "empty"])
def test_a_stream_broken_before_its_first_event_is_502(gw, model):
    status, lines = events(gw, f"fake/{model}")
    assert status == 502
    assert json.loads(lines[0])["error"]["code"] == "upstream_invalid_response"


def test_a_stream_broken_before_its_first_event_falls_back(client):
    chunks = list(client.completions.create(model="stream-fallback", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hello"


def test_faults_count_toward_cooldown(gw, fake_upstream):
    """cooldown_failures = 2: after two broken answers the target is skipped; a broken
    stream counts too, although its first byte had already gone out as a 200."""

    def fault_count(target):
        return sum(
            v
            for labels, v in metrics_values(gw.url, "headwise_gateway_upstream_faults_total").items()
            if dict(labels)["target"] == target
        )

    before = hits(fake_upstream, "badshape")
    for _ in range(4):
        r = httpx.post(gw.url + "/v1/completions", json={"model": "shape-cool", "prompt": "hi"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-headwise-target"] == "fake/ok"
    assert hits(fake_upstream, "badshape") == before + 2
    assert fault_count("fake/badshape") >= 2

    before, faults = hits(fake_upstream, "truncated"), fault_count("fake/truncated")
    targets = []
    for _ in range(4):
        status, lines = events(gw, "stream-cool")
        assert status == 200 and lines[-1] == "data: [DONE]"
        targets.append("error" in json.loads(lines[-2][6:]))
    assert targets == [True, True, False, False]  # then fake/ok, a clean stream
    assert hits(fake_upstream, "truncated") == before + 2
    cooling = metrics_values(gw.url, "headwise_gateway_target_cooling_down")
    assert cooling[(("target", "fake/truncated"),)] == 1.0
    assert fault_count("fake/truncated") == faults + 2
