"""`headwise serve MODEL...` (no TOML), `make run PORT=...`, and what `--self-check` prints: its
banner free of /health polls, and an openai snippet that runs as printed."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai

from headwise.models.builtin import resolve

from ..serve.conftest import free_port
from .conftest import ROOT


def test_serve_models_from_the_command_line_and_the_printed_snippet_runs(tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    minilm_dir = resolve("all-minilm-l6-v2")  # a checkpoint directory, by path
    env = {**os.environ, "HEADWISE_API_KEYS": ""}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headwise.cli",
            "serve",
            "smollm2",
            str(minilm_dir),
            "--port",
            str(port),
            "--self-check",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 400
        while "Serving; Ctrl-C to stop." not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        out = log.read_text()
        assert '"GET /health HTTP/1.1" 503' not in out, out  # the self-check does not poll while loading
        assert "httpx: HTTP Request" not in out, out

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"smollm2-135m-instruct", minilm_dir.name}
        with_template = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Hi"}]
        )
        assert with_template.choices[0].message.content
        assert len(client.embeddings.create(model=minilm_dir.name, input="a cat").data[0].embedding) == 384
        # --threads 1: the chat model's steps ran pinned at 1 (its engine's gauge), whatever the load
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert 'headwise_engine_threads{model="smollm2-135m-instruct"} 1.0' in metrics, metrics[-2000:]

        # the snippet exactly as printed, run in a shell of its own as a user pastes it
        snippet = re.search(r"^(\S+ - <<'EOF'\n.*?\nEOF)$", out, re.S | re.M).group(1)
        r = subprocess.run(
            ["bash", "-c", snippet],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
            cwd=tmp_path,
        )
        assert r.returncode == 0, (snippet, r.stderr)
        *text, cosine = r.stdout.strip().splitlines()
        assert "".join(text).strip(), r.stdout  # the streamed haiku
        assert 0.3 < float(cosine) <= 1.0, r.stdout  # cat vs kitten
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_make_run_passes_port_and_models():
    r = subprocess.run(["make", "-n", "run", "PORT=8123", "MODELS=smollm2"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "headwise serve --self-check smollm2 --port 8123" in " ".join(r.stdout.split()), r.stdout
