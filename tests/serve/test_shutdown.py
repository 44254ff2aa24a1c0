"""`headwise serve` as a real process: /health 503 while loading then 200; SIGTERM stops
accepting, lets the stream in flight finish, exits 0; the key never reaches its output."""

import json
import signal
import subprocess
import sys
import time

import httpx

from .conftest import free_port

KEY = "sk-subprocess-0123456789abcdef"


def test_sigterm_drains_in_flight_stream_and_exits_0(tiny_dir, tmp_path):
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[server]\napi_keys = ["{KEY}"]\napi_key_env = ""\ndrain_timeout = 20\n[models.tiny]\nsource = "{tiny_dir}"\n'
    )
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headwise.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.time() + 90
        while time.time() < deadline and 200 not in statuses:
            try:
                statuses.append(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                assert proc.poll() is None, "server exited early"
            time.sleep(0.05)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses  # loads after it listens

        body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = False
            try:
                httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                refused = True  # the listening socket is closed: no new connections
            rest = [line for line in lines if line.startswith("data: ")]
        assert refused
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in [first, *rest[:-1]]]
        assert len(rest) > 10  # most of the stream came after the signal
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    assert "Waiting for connections to close" in output or "Shutting down" in output, output
    assert KEY not in output
