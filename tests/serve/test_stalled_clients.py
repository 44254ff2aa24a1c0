"""A client that stops reading its stream is cut off (issue 43): four such clients kept generating to
max_tokens and held most of the KV blocks while megabytes sat in send queues. Now what a stream may
hold unsent is bounded, and once its client has drained nothing for [server] stall_timeout seconds
the request is aborted (its blocks free again) and the connection reset; /health answers meanwhile.

An in-process server of its own (the stall timeout at 2 s) over the tiny random Llama, its context
stretched to 4,096 positions so that the stream outlasts the stall by far.
"""

import json
import shutil
import socket
import time

import httpx
import pytest

from headwise.serve import create_app, parse_config

from .conftest import LiveServer
from .test_disconnect import engine_gauge

STALL = 2.0
PAUSE = 0.5  # a slow reader's pause: a quarter of the stall, so a loaded machine cannot close the gap
MAX_TOKENS = 4000


@pytest.fixture(scope="module")
def long_tiny(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    return path


@pytest.fixture(scope="module")
def srv(long_tiny):
    settings = {"api_key_env": "", "stall_timeout": STALL}  # the [server] key
    config = parse_config({"server": settings, "models": {"long": {"source": str(long_tiny), "max_num_seqs": 4}}})
    server = LiveServer(create_app(config)).start()
    yield server
    server.stop()


def silent_stream(srv, path: str, body: dict) -> socket.socket:
    """A streaming request from a socket with a tiny receive buffer that then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", srv.port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def read_until_closed(sock: socket.socket, within: float) -> int:
    """Bytes the client can still read before the server's reset or close; fails after `within` s."""
    sock.settimeout(within)
    got = 0
    try:
        while chunk := sock.recv(65536):
            got += len(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the connection is still open {within} s after the abort ({got} bytes read)")
    return got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(srv, path):
    total = engine_gauge(srv.url, "kv_blocks_total", "long")
    aborted = engine_gauge(srv.url, "requests_aborted", "long")
    body = {"model": "long", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    if path == "/v1/completions":
        body |= {"prompt": "Once upon a time", "logprobs": 5}  # ~0.4 KB a chunk: the buffers fill sooner
    else:
        body |= {"messages": [{"role": "user", "content": "Tell me a story."}], "logprobs": True, "top_logprobs": 5}
    sock = silent_stream(srv, path, body)
    try:
        t0, health = time.perf_counter(), []
        while True:
            h0 = time.perf_counter()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            health.append(time.perf_counter() - h0)
            done = engine_gauge(srv.url, "requests_aborted", "long") == aborted + 1
            if done and engine_gauge(srv.url, "running", "long") == 0:
                break
            # the buffers fill within a few hundred tokens, then STALL: far less than the 4,000 tokens
            assert time.perf_counter() - t0 < 60, "the silent client's request still runs after 60 s"
            time.sleep(0.05)
        assert engine_gauge(srv.url, "kv_blocks_free", "long") == total
        assert engine_gauge(srv.url, "waiting", "long") == 0
        assert max(health) < 2.0, health  # generous on a loaded machine; the server kept answering
        # what the client could still read: bounded by the stream's buffers (32 KiB kernel + 16 KiB
        # transport + its own few KiB), not the ~1.7 MB a loopback socket grows to by itself
        assert read_until_closed(sock, 10) < 256 * 1024
    finally:
        sock.close()
    # and the server serves the next one
    r = httpx.post(srv.url + "/v1/completions", json={"model": "long", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_a_slow_reader_that_keeps_up_is_not_cut(srv):
    """The clock counts only time in which nothing drained: a client with a small receive buffer that
    pauses after every 32 KiB (the server's buffers fill and its sends wait) for a quarter of the stall
    timeout gets its whole stream."""
    n = 600
    body = {
        "model": "long",
        "prompt": "Once",
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 5,
        "stream_options": {"include_usage": True},
    }
    sock = silent_stream(srv, "/v1/completions", body)
    sock.settimeout(30)
    got, paused = b"", 0
    try:
        while b"data: [DONE]" not in got[-64:]:
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream after {len(got)} bytes: {got[-300:]!r}"
            got += chunk
            if len(got) // (32 << 10) > paused:
                paused += 1
                time.sleep(PAUSE)
    finally:
        sock.close()
    assert paused >= 3, paused  # it did pause, with ~400 bytes a token
    assert b'"error"' not in got
    assert b'"completion_tokens":%d' % n in got, got[-400:]
