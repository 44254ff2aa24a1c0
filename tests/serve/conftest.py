"""Live servers for the serve tests, on random 127.0.0.1 ports.

`main` and `peer` run as `headwise serve --config FILE` processes, as users run them.
`main`: SmolLM2 (chat, completions), MiniLM (embeddings), two random tiny Llamas (fast
fuzzing; a 1-sequence engine whose queue fills at once), an API key, a 64 KiB body
limit, and a gateway over `peer` — a second headwise server serving the same tiny
model behind its own key — and `down`, a provider whose port has nothing listening.
Their output, and every log record of this process (for the in-thread servers of
`LiveServer`), is kept to check that no key is ever logged.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import secrets
import signal
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

import headwise

pytest.importorskip("fastapi", reason="needs the [serve] extra")
import openai  # noqa: E402
import uvicorn  # noqa: E402

from headwise.serve import parse_config  # noqa: E402
from headwise.serve.timeouts import timed_h11  # noqa: E402

MAIN_KEY = "sk-main-" + secrets.token_hex(12)
PEER_KEY = "sk-peer-" + secrets.token_hex(12)
PEER_KEY_ENV = "HEADWISE_TEST_PEER_KEY"
LOG = io.StringIO()


@pytest.fixture(scope="package", autouse=True)
def captured_logs():
    """Every record from every logger of this process while these tests run (uvicorn's access
    log included), formatted with its args."""
    handler = logging.StreamHandler(LOG)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "headwise", "httpx")
    levels = {n: logging.getLogger(n).level for n in names}
    logging.getLogger().addHandler(handler)
    for n in names:
        logging.getLogger(n).setLevel(logging.DEBUG)
    yield LOG
    logging.getLogger().removeHandler(handler)
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


@pytest.fixture(scope="package")
def smol(smollm2_fp32):
    # fp32 here and in the served config below: the tests hold the server's batched, paged steps to
    # generate()'s exact tokens, true where the arithmetic is fp32 throughout (tests/engine/test_smollm2.py)
    return smollm2_fp32  # the session's: headwise.load("smollm2-135m-instruct", weights="fp32")


@pytest.fixture(scope="package")
def minilm():
    return headwise.load("all-minilm-l6-v2")


def save_tiny_llama(path, tok, vocab_size: int):
    """A random 2-layer GQA Llama (4 query heads, 2 KV heads) with tokenizer `tok`, saved offline to `path`."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save(path)
    return path


@pytest.fixture(scope="package")
def tiny_dir(tmp_path_factory, smol):
    """A random 2-layer GQA Llama with SmolLM2's tokenizer and chat template, saved offline."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol.tokenizer, smol.config.vocab_size)


_PORTS = random.Random()  # not the global generator, which tests seed


def free_port() -> int:
    """A free port below the ephemeral range (32768-60999), which other processes' outgoing
    connections draw from: a port the kernel picked there could be taken before a server binds it."""
    while True:
        port = _PORTS.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class LiveServer:
    """uvicorn.Server on a socket we bound first (so the port is known and ours)."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the protocol `headwise serve` runs (read timeouts; the transport in the scope for direct.py)
        serve = getattr(app.state, "serve", None)
        http = timed_h11(30.0, 60.0, serve.config.server.direct_streams if serve is not None else True)
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_config=None, lifespan="on", timeout_graceful_shutdown=5, http=http, ws="none")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, ready_timeout: float = 120) -> "LiveServer":
        self.thread.start()
        if not wait_healthy(self.url, ready_timeout):
            raise RuntimeError(f"server on {self.url} not ready: {httpx.get(self.url + '/health').text}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_healthy(url: str, timeout: float, check=None) -> bool:
    """Poll GET /health until it answers 200 (True) or `timeout` seconds pass (False);
    `check()` runs before each try (to fail fast when the server died)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check:
            check()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def to_toml(data: dict) -> str:
    """Enough TOML for these configs: [table] / [table.name] of scalars, lists, inline tables."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"

    lines = []
    for table, body in data.items():
        nested = all(isinstance(x, dict) for x in body.values()) and table != "server"
        for name, entries in body.items() if nested else [(None, body)]:
            lines.append(f"[{table}.{json.dumps(name)}]" if name else f"[{table}]")
            lines += [f"{k} = {value(v)}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


class ServeProcess:
    """`headwise serve --config FILE` as a real process (as users run it), output to a file."""

    def __init__(self, config: dict, workdir, name: str, env: dict | None = None):
        self.config = parse_config(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"{name}.toml"
        path.write_text(to_toml(config))
        self.log_path = workdir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headwise.cli", "serve", "--config", str(path), "--port", str(self.port)],
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 240) -> "ServeProcess":
        def alive():
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"

        if not wait_healthy(self.url, timeout, alive):
            raise RuntimeError(f"server on {self.url} not ready after {timeout} s:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="package")
def servers_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="package")
def peer(tiny_dir, servers_dir):
    """The upstream provider: another headwise server, its own key."""
    server = ServeProcess(
        {"server": {"api_keys": [PEER_KEY], "api_key_env": ""}, "models": {"tiny": {"source": str(tiny_dir)}}},
        servers_dir,
        "peer",
    )
    yield server
    server.stop()


DOWN_PORT = free_port()  # nothing listens here


@pytest.fixture(scope="package")
def main(peer, tiny_dir, servers_dir):
    server = ServeProcess(
        {
            "server": {"api_keys": [MAIN_KEY], "api_key_env": "", "max_body_bytes": 64 * 1024},
            "models": {
                "smollm2": {"source": "smollm2-135m-instruct", "weights": "fp32", "max_num_seqs": 16},
                "minilm": {"source": "all-minilm-l6-v2"},
                "tiny": {"source": str(tiny_dir), "max_model_len": 96},
                "tiny-1seq": {"source": str(tiny_dir), "max_num_seqs": 1, "max_waiting_requests": 1},
            },
            "providers": {
                "peer": {"base_url": peer.url + "/v1", "api_key_env": PEER_KEY_ENV, "models": ["tiny"], "timeout": 30},
                "down": {"base_url": f"http://127.0.0.1:{DOWN_PORT}/v1", "models": ["tiny"], "timeout": 5},
            },
            "routes": {
                "spread": {
                    "targets": [{"target": "tiny", "weight": 1}, {"target": "peer/tiny", "weight": 1}],
                    "retries": 0,
                },
                "with-fallback": {
                    "targets": ["down/tiny"],
                    "fallbacks": ["tiny"],
                    "retries": 0,
                    "cooldown_failures": 2,
                    "cooldown_seconds": 600,
                },
            },
        },
        servers_dir,
        "main",
        env={PEER_KEY_ENV: PEER_KEY},
    )
    peer.wait_ready()
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="package")
def client(main):
    """The official OpenAI client; no retries, so each status shows as its own exception."""
    return openai.OpenAI(base_url=main.url + "/v1", api_key=MAIN_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(main):
    """Async client factory: one per asyncio.run, since a client's connections belong to its loop."""
    return lambda: openai.AsyncOpenAI(base_url=main.url + "/v1", api_key=MAIN_KEY, max_retries=0, timeout=300)


def metrics_values(url: str, name: str) -> dict[tuple, float]:
    """{labels tuple: value} of one metric family from /metrics (parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def auth(key: str = MAIN_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """The references (headwise.generate / embed) run in this process next to the servers:
    one thread each, so OpenMP workers of this process do not spin against the servers'."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- a fake upstream provider that misbehaves on request (the gateway's fault and leak tests) ---

FAKE_KEY = "sk-fake-" + secrets.token_hex(12)
FAKE_KEY_ENV = "HEADWISE_TEST_FAKE_KEY"


def _fake_upstream_app():
    """An OpenAI-compatible server whose behaviour is chosen by the request's `model`:
    `ok` answers properly (streamed or not); `echo-400` / `echo-500` / `echo-429` put the
    request's headers (Authorization included) into their error bodies and headers;
    `notjson`, `badshape`, `truncated`, `badevent`, `badfirst`, `errevent`, `empty` are
    broken answers. `/_hits` says how many requests each model got."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    hits = collections.Counter()

    def chunk(text, endpoint):
        if endpoint == "chat":
            return {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "fake",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            }
        return {
            "id": "c1",
            "object": "text_completion",
            "created": 1,
            "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}],
        }

    def answer(endpoint):
        if endpoint == "embeddings":
            return {
                "object": "list",
                "model": "fake",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        if endpoint == "chat":
            return {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "fake",
                "usage": usage,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hello there"},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
            }
        return {
            "id": "c1",
            "object": "text_completion",
            "created": 1,
            "model": "fake",
            "usage": usage,
            "choices": [{"index": 0, "text": "hello there", "finish_reason": "stop", "logprobs": None}],
        }

    def stream(events):
        async def gen():
            for e in events:
                yield e

        return StreamingResponse(gen(), media_type="text/event-stream")

    def handler(endpoint):
        async def handle(request: Request):
            body = await request.json()
            model = body.get("model")
            hits[model] += 1
            echo = json.dumps(dict(request.headers))
            echo_headers = {"x-echo": request.headers.get("authorization", "")}
            if model == "echo-400":
                return JSONResponse(
                    {
                        "error": {
                            "message": f"bad request; you sent {echo}",
                            "type": "invalid_request_error",
                            "param": "max_tokens",
                            "code": request.headers.get("authorization"),
                        }
                    },
                    status_code=400,
                    headers=echo_headers,
                )
            if model == "echo-400-plain":
                return JSONResponse(
                    {
                        "error": {
                            "message": f"too long; you sent {echo}",
                            "type": "invalid_request_error",
                            "param": "messages[0].content",
                            "code": "context_length_exceeded",
                        }
                    },
                    status_code=400,
                    headers=echo_headers,
                )
            if model == "echo-500":
                return PlainTextResponse(f"Internal error while handling {echo}", status_code=500, headers=echo_headers)
            if model == "echo-429":
                return JSONResponse(
                    {"error": {"message": f"slow down {echo}", "code": "rate_limit_exceeded"}},
                    status_code=429,
                    headers={**echo_headers, "retry-after": "3"},
                )
            if model == "notjson":
                return Response(b"{not json", media_type="application/json")
            if model == "badshape":
                return JSONResponse({"unexpected": True})
            if not body.get("stream"):
                return JSONResponse(answer(endpoint))
            good = [b"data: " + json.dumps(chunk(t, endpoint)).encode() + b"\n\n" for t in ("hel", "lo")]
            if model == "ok":
                return stream([*good, b"data: [DONE]\n\n"])
            if model == "truncated":
                return stream(good)
            if model == "badevent":
                return stream([good[0], b"data: {not json\n\n", good[1], b"data: [DONE]\n\n"])
            if model == "badfirst":
                return stream([b"data: {not json\n\n", *good, b"data: [DONE]\n\n"])
            if model == "errevent":
                return stream(
                    [
                        good[0],
                        b"data: "
                        + json.dumps({"error": {"message": f"died: {echo}", "code": "engine_dead"}}).encode()
                        + b"\n\n",
                    ]
                )
            if model == "empty":
                return stream([])
            if model == "crlf":  # legal SSE, awkwardly cut: CRLF, a comment, split events
                text = b": ping\r\n\r\n" + b"".join(g.replace(b"\n\n", b"\r\n\r\n") for g in good) + b"data: [DONE]"
                return stream([text[i : i + 7] for i in range(0, len(text), 7)])
            return JSONResponse({"error": {"message": f"unknown model {model}"}}, status_code=404)

        return handle

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def get_hits(request):
        return JSONResponse(dict(hits))

    routes = [
        Route("/v1/chat/completions", handler("chat"), methods=["POST"]),
        Route("/v1/completions", handler("completions"), methods=["POST"]),
        Route("/v1/embeddings", handler("embeddings"), methods=["POST"]),
        Route("/health", health),
        Route("/_hits", get_hits),
    ]
    return Starlette(routes=routes)


FAKE_MODELS = [
    "ok",
    "echo-400",
    "echo-400-plain",
    "echo-500",
    "echo-429",
    "notjson",
    "badshape",
    "truncated",
    "badevent",
    "badfirst",
    "errevent",
    "empty",
    "crlf",
]


@pytest.fixture(scope="package")
def fake_upstream():
    """The misbehaving upstream, in this process; its key is in FAKE_KEY_ENV while it runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAKE_KEY_ENV, FAKE_KEY)
        server = LiveServer(_fake_upstream_app()).start()
        yield server
        server.stop()


@pytest.fixture(scope="package")
def gateway_factory(fake_upstream):
    """gateway_factory(server={...}, routes={...}) -> a started LiveServer of create_app over the
    fake upstream (provider `fake`, every FAKE_MODELS name), no local models; stopped at the end."""
    from headwise.serve import create_app

    started = []

    def make(server: dict | None = None, routes: dict | None = None) -> LiveServer:
        config = {
            "server": {"api_key_env": "", **(server or {})},
            "providers": {
                "fake": {
                    "base_url": fake_upstream.url + "/v1",
                    "api_key_env": FAKE_KEY_ENV,
                    "models": FAKE_MODELS,
                    "timeout": 10,
                }
            },
            "routes": routes or {},
        }
        live = LiveServer(create_app(parse_config(config))).start()
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()
