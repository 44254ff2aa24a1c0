"""A server's life: models that fail to load (one: exit 1 with the reason; one of several:
reported, the others serve), variants of one checkpoint sharing one set of weights,
clients that hang up while queued (dropped before any prefill), and the drain deadline
(streams still running end with an error event and [DONE], no traceback)."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from headwise.serve import create_app, parse_config
from headwise.cli.serve import _self_check
from headwise.serve.config import load_config
from headwise.serve.local import default_loader, weights_key

from .conftest import LiveServer, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def serve(tmp_path, toml: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(toml)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "headwise.cli", "serve", "--config", str(config), "--port", str(port), *extra],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}", log


def test_the_only_model_failing_to_load_exits_1_with_the_reason(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc, _, log = serve(
        tmp_path, f'[server]\napi_key_env = ""\n[models.ghost]\nsource = "{missing}"\n', "--self-check"
    )
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert code == 1, output
    assert "headwise serve: no model could be loaded: ghost:" in output
    assert str(missing) in output  # the reason names the file
    assert "Traceback" not in output


def test_a_failed_model_is_reported_and_the_others_serve(tiny_dir, tmp_path):
    missing = tmp_path / "gone"
    app = create_app(
        parse_config(
            {
                "server": {"api_key_env": None},
                "models": {"good": {"source": str(tiny_dir)}, "bad": {"source": str(missing)}},
            }
        )
    )
    server = LiveServer(app).start(ready_timeout=120)
    try:
        r = httpx.get(server.url + "/health")
        body = r.json()
        assert r.status_code == 200 and body["status"] == "degraded"
        assert body["models"] == {"good": "ready", "bad": "failed"}
        assert str(missing) in body["errors"]["bad"]
        models = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert models["good"]["status"] == "ready" and "error" not in models["good"]
        assert models["bad"]["status"] == "failed" and str(missing) in models["bad"]["error"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert {m.id for m in client.models.list()} == {"good", "bad"}  # the official client reads it
        out = client.completions.create(model="good", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="bad", prompt="Hello", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "model_unavailable"
        assert str(missing) in e.value.body["message"]
    finally:
        server.stop()


def test_self_check_stops_waiting_when_every_model_failed(tmp_path, capsys):
    config = parse_config({"server": {"api_key_env": None}, "models": {"bad": {"source": str(tmp_path / "nope")}}})
    server = LiveServer(create_app(config))  # in a thread: nobody stops it, /health stays 503
    server.thread.start()
    try:
        checker = threading.Thread(target=_self_check, args=(server.url, config, []), daemon=True)
        checker.start()
        checker.join(60)
        assert not checker.is_alive(), "the self-check still polls /health"
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"
        assert "no model could be loaded" in capsys.readouterr().err
    finally:
        server.stop()


def test_variants_of_one_checkpoint_share_one_model(tiny_dir):
    calls = []

    def counting_loader(spec):
        calls.append(spec.name)
        return default_loader(spec)

    app = create_app(
        parse_config(
            {
                "server": {"api_key_env": None},
                "models": {"fp32": {"source": str(tiny_dir)}, "int8": {"source": str(tiny_dir), "cache": "int8"}},
            }
        ),
        loader=counting_loader,
    )
    server = LiveServer(app).start(ready_timeout=120)
    try:
        rts = app.state.serve.runtimes
        assert calls == ["fp32"]  # loaded once
        assert rts["fp32"].model is rts["int8"].model
        assert rts["fp32"].engine is not rts["int8"].engine
        assert rts["fp32"].engine.cache.kv_dtype is None and rts["int8"].engine.cache.kv_dtype == "int8"
        a = {n: p.data_ptr() for n, p in rts["fp32"].engine.model.named_parameters()}
        b = {n: p.data_ptr() for n, p in rts["int8"].engine.model.named_parameters()}
        assert a == b  # the same storage, not a copy
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for name in ("fp32", "int8"):
            out = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
    finally:
        server.stop()


def test_example_gateway_variants_share_weights():
    config = load_config(REPO / "examples" / "gateway.toml")
    assert weights_key(config.models["smollm2"]) == weights_key(config.models["smollm2-int8"])
    assert config.models["smollm2"].cache != config.models["smollm2-int8"].cache


def test_queued_streams_that_hang_up_are_dropped_without_a_prefill(tiny_dir):
    """One sequence slot, taken by a long stream; 40 more streams queue behind it and their
    clients hang up before any byte came back: each is dropped at once, none is prefilled."""

    def slow_loader(spec):  # ~20 ms a forward, so the long stream holds the slot for seconds
        model = default_loader(spec)
        model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
        return model

    app = create_app(
        parse_config(
            {
                "server": {"api_key_env": None},
                "models": {"tiny": {"source": str(tiny_dir), "max_num_seqs": 1, "max_waiting_requests": 64}},
            }
        ),
        loader=slow_loader,
    )
    server = LiveServer(app).start(ready_timeout=120)
    engine = app.state.serve.runtimes["tiny"].engine
    try:
        tok = app.state.serve.runtimes["tiny"].tokenizer
        long_body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        quit_body = json.dumps(
            {
                "model": "tiny",
                "prompt": "A different prompt that is a good deal longer",
                "max_tokens": 8,
                "stream": True,
            }
        ).encode()
        raw = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(quit_body)}\r\n\r\n"
        ).encode() + quit_body
        with httpx.stream("POST", server.url + "/v1/completions", json=long_body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the long stream runs
            before = engine.stats().prefill_tokens
            socks = []
            for _ in range(40):
                s = socket.create_connection(("127.0.0.1", server.port))
                s.sendall(raw)
                socks.append(s)
            deadline = time.time() + 10
            while engine.stats().waiting < 40 and time.time() < deadline:
                time.sleep(0.02)
            assert engine.stats().waiting == 40
            for s in socks:
                s.close()  # hung up before a byte came
            t0 = time.perf_counter()
            while engine.stats().waiting and time.perf_counter() - t0 < 5:
                time.sleep(0.02)
            assert engine.stats().waiting == 0, "the queued requests outlived their clients"
            assert engine.stats().running == 1  # the long one still runs
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        s = engine.stats()
        assert s.prefill_tokens == before  # none of the 40 ran a prefill
        assert s.requests_aborted >= 40 and s.waiting == s.running == 0
        assert len(tok.encode("A different prompt that is a good deal longer")) > 1
    finally:
        server.stop()


def test_drain_deadline_ends_running_streams_with_an_error_event(tmp_path):
    proc, url, log = serve(
        tmp_path,
        '[server]\napi_key_env = ""\ndrain_timeout = 2\n'
        '[models.smollm2]\nsource = "smollm2-135m-instruct"\nmax_num_seqs = 4\n',
    )
    try:

        def alive():
            assert proc.poll() is None, log.read_text()

        assert wait_healthy(url, 240, alive), log.read_text()
        body = {
            "model": "smollm2",
            "prompt": "Once upon a time",
            "max_tokens": 4000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            t0 = time.perf_counter()
            rest = [line for line in lines if line.startswith("data: ")]
            took = time.perf_counter() - t0
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(rest[-2][6:])
        assert set(last) == {"error"} and last["error"]["code"] == "aborted", last
        assert took < 10  # cut at the deadline, not after 4,000 tokens
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output
    assert "drain timeout (2 s): ended 1 request(s) still running" in output
