"""The gateway with a second headwise server (`peer`) as the upstream provider, serving
the same tiny model as the local `tiny`: routing, fallback, cooldown, pass-through."""

import collections
import json

import httpx
import openai
import pytest

from .conftest import PEER_KEY, auth, metrics_values

PROMPT = "The quick brown fox"


def completion(main, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(main.url + "/v1/completions", json=body, headers=auth(), timeout=60)


def served(url: str, model: str = "tiny") -> float:
    """Completions the server at url answered for `model` (its own request counter)."""
    return sum(
        v
        for labels, v in metrics_values(url, "headwise_requests_total").items()
        if dict(labels) == {"model": model, "endpoint": "completions", "status": "200"}
    )


def test_upstream_answers_equal_local_ones(client, main, peer):
    """Same weights on both sides, greedy: the answer through the upstream equals the
    local one, streamed or not, and the upstream really served it."""
    before = served(peer.url)
    local = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    remote = client.completions.create(model="peer/tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert remote.choices[0].text == local.choices[0].text
    assert remote.usage.completion_tokens == local.usage.completion_tokens == 12
    assert served(peer.url) == before + 1
    chunks = list(
        client.chat.completions.create(
            model="peer/tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    ref = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_stream_passes_through_unchanged(main):
    body = {"model": "peer/tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", main.url + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-headwise-target"] == "peer/tiny"
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert {c["model"] for c in chunks} == {"tiny"}  # the upstream's own name: passed through untouched


def test_weighted_route_spreads(main, peer):
    before = served(peer.url)
    targets = collections.Counter()
    for _ in range(24):
        r = completion(main, "spread")
        assert r.status_code == 200, r.text
        targets[r.headers["x-headwise-target"]] += 1
        assert r.json()["model"] in ("spread", "tiny")
    assert set(targets) == {"tiny", "peer/tiny"}  # 1:1 weights; all 24 on one side: p = 2 * 2^-24
    assert served(peer.url) == before + targets["peer/tiny"]


def test_fallback_then_cooldown(main):
    """`with-fallback` -> down/tiny (nothing listening) then tiny. After 2 failures in a row
    down/tiny cools down: later requests go straight to tiny without trying it."""

    def errors():
        return metrics_values(main.url, "headwise_gateway_attempts_total").get(
            (("outcome", "error"), ("route", "with-fallback"), ("target", "down/tiny")), 0.0
        )

    start = errors()
    for i in range(5):
        r = completion(main, "with-fallback", stream=i % 2 == 1)
        assert r.status_code == 200, r.text
        assert r.headers["x-headwise-target"] == "tiny"
    assert errors() - start == 2
    cooling = metrics_values(main.url, "headwise_gateway_target_cooling_down")
    assert cooling[(("target", "down/tiny"),)] == 1.0


def test_upstream_down_without_fallback_is_502(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="down/tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_unreachable"


def test_upstream_client_errors_pass_through(client, peer):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="peer/tiny", prompt=PROMPT, max_tokens=500)
    assert e.value.body["code"] == "context_length_exceeded"
    # the upstream requires its key: the gateway sent the configured one
    assert httpx.get(peer.url + "/v1/models").status_code == 401
    assert httpx.get(peer.url + "/v1/models", headers=auth(PEER_KEY)).status_code == 200
