"""Cheap work does not wait behind big bodies (issue 43): eight 3.8 MiB bodies, each a 400 in the
end, kept a one-line chat waiting 10 s, since the pool that renders and tokenizes served first come,
first served. Jobs now say their size (the body's length) and small ones have a lane of their own.

An in-process server over the tiny random Llama (256 positions: every big body is too long, a 400
after tokenizing, as in the issue).
"""

import threading
import time

import httpx
import pytest

from headwise.serve import create_app, parse_config

from .conftest import LiveServer

BIG, BIG_CHARS = 6, 512 << 10  # more bodies than the big lane has workers (4): some queue
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv(tiny_dir):
    config = parse_config(
        {
            "server": {"api_key_env": "", "max_body_bytes": 8 << 20},
            "models": {"tiny": {"source": str(tiny_dir), "max_input_chars": 8_000_000}},
        }
    )
    server = LiveServer(create_app(config)).start()
    yield server
    server.stop()


def tiny_chat(srv) -> float:
    t0 = time.perf_counter()
    body = {"model": "tiny", "messages": MSG, "max_tokens": 1, "temperature": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def test_a_tiny_chat_does_not_wait_behind_big_bodies(srv):
    alone = min(tiny_chat(srv) for _ in range(3))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "attention heads " * (BIG_CHARS // 16)}]}
    t0, results = time.perf_counter(), []

    def big():
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        results.append((r.status_code, r.json()["error"]["code"], time.perf_counter() - t0))

    threads = [threading.Thread(target=big) for _ in range(BIG)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the bodies are in (0.5 MiB each over loopback); their jobs are running or queued
    beside = tiny_chat(srv)
    tiny_done = time.perf_counter() - t0
    for t in threads:
        t.join()
    assert [r[:2] for r in results] == [(400, "context_length_exceeded")] * BIG, results
    last = max(r[2] for r in results)
    assert tiny_done < last, (tiny_done, results)  # the big ones were still at work meanwhile
    # generous for a loaded 2-core machine; first come, first served it waited for four big jobs
    assert beside < 10 * alone + 0.5 and beside < last / 2, (beside, alone, last)
