"""A client that hangs up aborts its engine request: within 1 s /metrics shows nothing
running and every KV block free again."""

import json
import time

import httpx

from .conftest import auth, metrics_values


def engine_gauge(url: str, field: str, model: str = "smollm2") -> float:
    return metrics_values(url, f"headwise_engine_{field}")[(("model", model),)]


def wait_idle(url: str, model: str = "smollm2", within: float = 1.0) -> float:
    """Seconds until running == waiting == 0 and used blocks == 0; fails after `within`."""
    t0 = time.perf_counter()
    while True:
        idle = (
            engine_gauge(url, "running", model) == 0
            and engine_gauge(url, "waiting", model) == 0
            and engine_gauge(url, "kv_blocks_used", model) == 0
        )
        if idle:
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < within, "engine still holds the request 1 s after the disconnect"
        time.sleep(0.02)


def test_stream_disconnect_frees_blocks(main):
    total = engine_gauge(main.url, "kv_blocks_total")
    aborted = engine_gauge(main.url, "requests_aborted")
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", main.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: dropping it would close the connection already
            events = []
            while len(events) < 4:
                line = next(lines)
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
            assert engine_gauge(main.url, "running") == 1  # it really is generating
            assert engine_gauge(main.url, "kv_blocks_used") > 0
        # leaving the block closes the connection mid-stream
    wait_idle(main.url)
    assert engine_gauge(main.url, "kv_blocks_free") == total
    assert engine_gauge(main.url, "requests_aborted") == aborted + 1


def test_non_streaming_disconnect_frees_blocks(main):
    aborted = engine_gauge(main.url, "requests_aborted")
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    try:
        httpx.post(main.url + "/v1/completions", json=body, headers=auth(), timeout=1.5)
        raise AssertionError("400 tokens came back within 1.5 s; make the request longer")
    except httpx.ReadTimeout:
        pass  # the client gave up and closed
    wait_idle(main.url)
    assert engine_gauge(main.url, "requests_aborted") == aborted + 1
