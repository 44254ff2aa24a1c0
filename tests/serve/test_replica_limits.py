"""A replica is read under the caps and deadlines a provider is (issue 43): a 1.5 GB answer or a gzip
bomb is a 502 naming the cap, with this process's memory flat; a replica that sends one event and
then `:` keep-alives forever loses the stream at its idle timeout, and one that keeps sending slowly
ends at the stream's total timeout. The misbehaving server is test_upstream_secrets.py's fake,
standing in as the only replica of [replicas.pool].
"""

import json
import time

import httpx
import pytest

from headwise.serve import create_app, parse_config

from .conftest import LiveServer
from .test_upstream_secrets import MSG, PeakGrowth, _upstream_app, sse_events

CAP = 8 << 20
IDLE, TOTAL = 1.0, 2.5
MODELS = ["ok", "huge", "bomb", "bomb-500", "drip", "slow", "gzip"]


@pytest.fixture(scope="module")
def gw():
    replica = LiveServer(_upstream_app()).start()
    pool = {"urls": [replica.url], "models": MODELS, "timeout": IDLE, "health_interval": 0.2}
    pool |= {"max_response_bytes": CAP, "total_timeout": TOTAL}  # the [replicas.NAME] keys
    config = parse_config({"server": {"api_key_env": ""}, "replicas": {"pool": pool}})
    server = LiveServer(create_app(config)).start()
    yield server
    server.stop()
    replica.stop()


def replica_up(gw, within: float = 10.0) -> None:
    """A stream that dies marks its replica down until the next /health poll (every 0.2 s here)."""
    deadline = time.monotonic() + within
    while set(httpx.get(gw.url + "/health").json().get("replicas", {}).get("pool", {}).values()) != {"up"}:
        assert time.monotonic() < deadline, httpx.get(gw.url + "/health").text
        time.sleep(0.05)


@pytest.mark.parametrize("model", ["huge", "bomb"])
def test_a_too_big_answer_is_a_502_naming_the_cap(gw, model):
    replica_up(gw)
    with PeakGrowth() as growth:
        body = {"model": f"pool/{model}", "messages": MSG}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as r:
            status = r.status_code
            answer = r.read() if status != 200 else b""  # a 200 here would be the whole body: not read
    assert status == 502, f"{model}: answered {status}"
    error = json.loads(answer)["error"]
    assert error["code"] == "upstream_too_large", error
    assert f"{CAP} bytes" in error["message"] and "[replicas.pool] max_response_bytes" in error["message"], error
    assert growth.mb < 50, f"{model}: resident memory grew {growth.mb:.0f} MB"


def test_a_bomb_in_an_error_body_is_bounded(gw):
    replica_up(gw)
    with PeakGrowth() as growth:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "pool/bomb-500", "messages": MSG}, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "replica_error", r.text
    assert growth.mb < 50, f"resident memory grew {growth.mb:.0f} MB"


def test_compressed_answers_still_pass(gw):
    replica_up(gw)
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "pool/gzip", "messages": MSG}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello", r.text
    events, _ = sse_events(gw, "/v1/chat/completions", {"model": "pool/gzip", "messages": MSG, "stream": True})
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]] == ["hel", "lo"]


@pytest.mark.parametrize("model, seconds, named", [("drip", IDLE, "idle_timeout"), ("slow", TOTAL, "total_timeout")])
def test_a_stream_that_never_ends_ends_at_its_deadline(gw, model, seconds, named):
    """drip: one event, then `:` keep-alives every 50 ms; slow: an event every 200 ms for a minute.
    The one replica is the only one: the stream cannot move and ends with an error event."""
    replica_up(gw)
    body = {"model": f"pool/{model}", "messages": MSG, "stream": True, "max_tokens": 4}
    events, took = sse_events(gw, "/v1/chat/completions", body)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "replica_failed" and named in error["message"], error
    assert f"{seconds:g} s" in error["message"] and "[replicas.pool]" in error["message"], error
    assert seconds <= took < seconds + 2, took
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "hel"  # what came before is kept
