"""One request must not stall everyone: huge prompts are tokenized off the event loop and
bounded, embeddings requests take turns, slow clients time out, bad types and paths are 400/404.

A `headwise serve --config` process of its own: short read timeouts, an 8 MiB body limit, the
tiny Llama with room for a 4 MiB prompt, MiniLM, and a MiniLM variant with small limits.
"""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from headwise.runtime.sampling import MAX_STOP_CHARS, MAX_STOPS

from .conftest import ServeProcess

HEADER_TIMEOUT, BODY_TIMEOUT = 2.0, 3.0
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv(tiny_dir, servers_dir):
    server = ServeProcess(
        {
            "server": {
                "api_key_env": "",
                "max_body_bytes": 8 * 2**20,
                "header_timeout": HEADER_TIMEOUT,
                "body_timeout": BODY_TIMEOUT,
            },
            "models": {
                "tiny": {"source": str(tiny_dir), "max_input_chars": 8_000_000},
                "minilm": {"source": "all-minilm-l6-v2"},
                "minilm-small": {"source": "all-minilm-l6-v2", "max_input_chars": 10_000, "max_embedding_tokens": 1000},
            },
        },
        servers_dir,
        "abuse",
    )
    yield server.wait_ready()
    server.stop()


def envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def still_serving(srv):
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 1. CPU work off the loop
def test_huge_prompt_does_not_stall_health(srv):
    """A 4 MiB chat message takes seconds to tokenize (then it is too long for the context:
    400); meanwhile /health answers at once."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "attention heads " * (2**18)}]}
    result = {}

    def huge():
        t0 = time.perf_counter()
        result["r"] = post(srv, "/v1/chat/completions", body, timeout=300)
        result["seconds"] = time.perf_counter() - t0

    t = threading.Thread(target=huge)
    t.start()
    time.sleep(0.3)  # the body is in; tokenizing has begun
    health = []
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    r = result["r"]
    assert r.status_code == 400 and envelope(r)["code"] == "context_length_exceeded", r.text
    assert len(health) >= 3, (result["seconds"], health)
    # generous for a loaded machine, and clearly below the huge request's own time
    assert max(health) < min(1.0, result["seconds"] / 3), (max(health), result["seconds"])
    still_serving(srv)


def test_input_limits_are_400_naming_the_limit(srv):
    r = post(srv, "/v1/embeddings", {"model": "minilm-small", "input": "x" * 10_001})
    assert r.status_code == 400, r.text
    e = envelope(r)
    assert (
        e["code"] == "input_too_long"
        and e["param"] == "input"
        and "10,000" in e["message"]
        and "max_input_chars" in e["message"]
    )
    r = post(srv, "/v1/embeddings", {"model": "minilm-small", "input": ["a " * 250] * 16})
    e = envelope(r)
    assert (
        r.status_code == 400
        and e["code"] == "input_too_long"
        and "1,000" in e["message"]
        and "max_embedding_tokens" in e["message"]
    ), r.text
    # one input over the model's 512 positions: a 400 naming it, as OpenAI does (no silent cut)
    r = post(srv, "/v1/embeddings", {"model": "minilm", "input": ["short", "attention " * 600]})
    e = envelope(r)
    assert (
        r.status_code == 400
        and e["code"] == "context_length_exceeded"
        and "input[1]" in e["message"]
        and "512" in e["message"]
    ), r.text
    r = post(srv, "/v1/embeddings", {"model": "minilm", "input": ["hi"] * 2049})
    assert r.status_code == 400 and envelope(r)["param"] == "input", r.text
    # ... while 300 tokens (over max_seq_length 256, under 512 positions) still embed, truncated
    r = post(srv, "/v1/embeddings", {"model": "minilm", "input": "attention " * 298})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256, r.text
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": ["a"] * 3 + ["x" * 8_000_000]})
    e = envelope(r)
    assert r.status_code == 400 and e["param"] == "prompt" and "8,000,000" in e["message"], r.text


# ---------------------------------------------------------------- 2. stop strings bounded
def test_stop_limits(srv):
    base = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    r = post(srv, "/v1/chat/completions", {**base, "stop": [str(i) for i in range(MAX_STOPS + 1)]})
    assert r.status_code == 400 and envelope(r)["param"] == "stop" and str(MAX_STOPS) in envelope(r)["message"]
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": "x" * (MAX_STOP_CHARS + 1)})
    assert r.status_code == 400 and envelope(r)["param"] == "stop" and str(MAX_STOP_CHARS) in envelope(r)["message"]
    r = post(srv, "/v1/chat/completions", {**base, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOPS})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 3. read timeouts
def raw(srv, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send `data`, then stay silent; -> (everything the server sent, seconds until it closed)."""
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.settimeout(wait)
        t0 = time.perf_counter()
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            return got, float("inf")  # still open
        return got, time.perf_counter() - t0


SLOW_CLIENTS = {
    "silent": (b"", HEADER_TIMEOUT),  # connect, say nothing
    "partial-headers": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
        HEADER_TIMEOUT,
    ),  # slowloris
    "partial-body": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": "ti',
        BODY_TIMEOUT,
    ),  # a body cut short
}


@pytest.fixture(scope="module")
def slow_clients(srv):
    """name -> (what the server sent, seconds until it closed) for each of SLOW_CLIENTS, all three
    connected at once (each only waits on the server's clock: one after the other took 7 s)."""
    with ThreadPoolExecutor(max_workers=len(SLOW_CLIENTS)) as pool:
        futures = {name: pool.submit(raw, srv, data, limit + 20) for name, (data, limit) in SLOW_CLIENTS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", SLOW_CLIENTS)
def test_slow_clients_get_408_and_a_closed_connection(srv, slow_clients, name):
    (_, limit), (got, seconds) = SLOW_CLIENTS[name], slow_clients[name]
    assert seconds < limit + 5, "the server kept a silent connection open"
    assert seconds >= limit - 0.5, seconds
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b'"code": "request_timeout"' in got and b"_timeout" in got, got
    still_serving(srv)


def test_kept_alive_connection_still_served_after_an_answer(srv):
    """The clocks restart per request: two requests on one connection, slower than the header
    timeout apart (uvicorn's own keep-alive of 5 s covers the idle gap)."""
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        time.sleep(HEADER_TIMEOUT + 0.5)
        assert c.get("/health").status_code == 200


# ---------------------------------------------------------------- 4. embeddings take turns
def test_small_embedding_finishes_before_an_earlier_large_one(srv):
    # 160 texts of ~240 tokens: 10 micro-batches of EMBED_BATCH (~1 s each on a core), long enough to
    # be running when the small one comes and to show a wait for it (512 took a minute and a half here)
    large = {"model": "minilm", "input": [f"{i} " + "multi-head attention layers " * 40 for i in range(160)]}
    done = {}

    def run(name, body):
        r = post(srv, "/v1/embeddings", body, timeout=600)
        assert r.status_code == 200, r.text
        done[name] = time.perf_counter()

    t = threading.Thread(target=run, args=("large", large))
    t0 = time.perf_counter()
    t.start()
    time.sleep(1.5)  # the large one holds the model by now
    sent = time.perf_counter()
    run("small", {"model": "minilm", "input": "a cat"})
    t.join()
    small, large_ = done["small"] - sent, done["large"] - t0
    # the small one waits for a micro-batch, not for the large request: it is answered long before
    # (one lock over the whole request: it finished a few ms before the large one's answer, 71 s vs 72 s)
    assert done["small"] < done["large"] and small < large_ / 3, (small, large_)


# ---------------------------------------------------------------- 5. strict types, exact paths
@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "logprobs", "yes"),
        ("/v1/chat/completions", "max_tokens", "5"),
        ("/v1/chat/completions", "temperature", "0.5"),
        ("/v1/chat/completions", "stream", 1),
        ("/v1/completions", "n", 1.5),
        ("/v1/completions", "echo", "false"),
        ("/v1/embeddings", "dimensions", "384"),
    ],
)
def test_strict_types(srv, path, field, value):
    body = (
        {"model": "minilm", "input": "hi"}
        if path.endswith("embeddings")
        else {
            "model": "tiny",
            "max_tokens": 2,
            **({"prompt": "hi"} if path == "/v1/completions" else {"messages": MSG}),
        }
    )
    r = post(srv, path, {**body, field: value})
    assert r.status_code == 400, r.text
    assert envelope(r)["param"] == field, r.text


def test_numbers_still_take_ints(srv):
    r = post(
        srv,
        "/v1/chat/completions",
        {"model": "tiny", "messages": MSG, "max_tokens": 2, "temperature": 0, "top_p": 1, "logprobs": True},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "method, path",
    [("POST", "/v1/chat/completions/"), ("POST", "/v1/embeddings/"), ("GET", "/v1/models/"), ("GET", "/health/")],
)
def test_trailing_slash_is_404_with_the_envelope_not_a_redirect(srv, method, path):
    r = httpx.request(method, srv.url + path, json={"model": "tiny", "messages": MSG}, follow_redirects=False)
    assert r.status_code == 404, (r.status_code, r.headers)
    e = envelope(r)
    assert e["type"] == "not_found_error" and path.rstrip("/") in e["message"]


def test_limits_are_validated_in_the_config():
    from headwise.serve import parse_config
    from headwise.serve.config import ConfigError

    with pytest.raises(ConfigError, match=r"\[server\] header_timeout must be > 0"):
        parse_config({"server": {"header_timeout": 0}, "models": {"m": {"source": "x"}}})
    with pytest.raises(ConfigError, match=r"\[models.m\] max_embedding_tokens must be >= 1"):
        parse_config({"models": {"m": {"source": "x", "max_embedding_tokens": 0}}})
    config = parse_config({"server": {"body_timeout": 5}, "models": {"m": {"source": "x"}}})
    assert config.server.body_timeout == 5
