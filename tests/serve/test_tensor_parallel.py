"""`headwise serve` with a model's heads split over 2 processes (tensor_parallel = 2).

One server process (`headwise serve --config`, 1 torch thread per rank) serves `tp`, a random
tiny GQA Llama split over itself (rank 0) and one follower process, and `plain`, the same
checkpoint unsplit. The reference is headwise.generate on the unsplit model in this process.
The last test kills the follower in the middle of a request: that request and the ones after
it get a 503 naming the failure, /health says degraded, `plain` goes on serving, and the
server still shuts down cleanly.
"""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import headwise
from headwise.serve import ConfigError, create_app, parse_config

from .conftest import ServeProcess, free_port, metrics_values, save_tiny_llama

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    """A random 2-layer Llama, 4 query / 2 KV heads, with SmolLM2's tokenizer and chat template
    (read from the GGUF's metadata: no weights converted), saved as a checkpoint folder."""
    from headwise.models.builtin import resolve
    from headwise.models.gguf import open_gguf
    from headwise.models.gguf_meta import gguf_tokenizer, read_metadata

    gguf = resolve("smollm2-135m-instruct")
    reader = open_gguf(gguf)
    tok = gguf_tokenizer(reader, read_metadata(reader), gguf)
    return save_tiny_llama(tmp_path_factory.mktemp("tp-llama"), tok, tok.vocab_size)


@pytest.fixture(scope="module")
def reference(tp_dir):
    """The same checkpoint, not split, in this process."""
    return headwise.load(str(tp_dir))


@pytest.fixture(scope="module")
def server(tp_dir, tmp_path_factory):
    config = {
        "server": {"api_key_env": ""},
        "models": {
            "tp": {"source": str(tp_dir), "tensor_parallel": 2, "max_num_seqs": 4},
            "plain": {"source": str(tp_dir)},
        },
    }
    proc = ServeProcess(config, tmp_path_factory.mktemp("tp-server"), "tp", env={"OMP_NUM_THREADS": "1"})
    try:
        yield proc.wait_ready(timeout=180)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _follower_pids(server_pid: int) -> list[int]:
    """The server's follower processes: children of its multiprocessing fork server (a child of the server)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    forkservers = [p for p, ppid in parents.items() if ppid == server_pid and _is_forkserver(p)]
    return [p for p, ppid in parents.items() if ppid in forkservers]


def _is_forkserver(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.forkserver" in f.read()
    except OSError:
        return False


def test_the_model_is_split_over_a_second_process(server):
    followers = _follower_pids(server.proc.pid)
    assert len(followers) == 1, followers
    cards = {m["id"]: m.get("headwise", {}) for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["tp"]["tensor_parallel"] == 2 and "tensor_parallel" not in cards["plain"]
    # rank 0's KV pool holds 1 of the 2 KV heads: half the bytes per token of the unsplit model's
    assert 2 * cards["tp"]["kv_bytes_per_token"] == cards["plain"]["kv_bytes_per_token"]


def test_greedy_completions_equal_generate(client, reference):
    for prompt in PROMPTS[:2]:
        ref = headwise.generate(reference, prompt, max_new_tokens=12, temperature=0)
        out = client.completions.create(model="tp", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.text, prompt
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.choices[0].finish_reason == ref.finish_reason


def test_greedy_chat_streamed_equals_generate(client, reference):
    ref = headwise.generate(reference, CHAT, max_new_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tp", messages=CHAT, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_concurrent_requests_equal_generate(server, reference):
    """Four requests at once (two streamed), batched by rank 0's engine into the same steps."""
    refs = [headwise.generate(reference, p, max_new_tokens=20, temperature=0) for p in PROMPTS]

    async def one(client, prompt, stream):
        if not stream:
            out = await client.completions.create(model="tp", prompt=prompt, max_tokens=20, temperature=0)
            return out.choices[0].text
        text = ""
        async for chunk in await client.completions.create(
            model="tp", prompt=prompt, max_tokens=20, temperature=0, stream=True
        ):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p, i % 2 == 1) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(main()) == [r.text for r in refs]


def test_bad_sizes_are_refused_before_anything_loads(tp_dir, tmp_path):
    def serve(*args):
        return subprocess.run(
            [sys.executable, "-m", "headwise.cli", "serve", str(tp_dir), "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    three = serve("--tensor-parallel", "3")  # the checkpoint's config.json has 2 KV heads: 1 or 2
    assert three.returncode == 2, three.stdout + three.stderr
    assert "cannot split 2 KV heads over 3 ranks" in three.stderr
    assert "Legal tensor-parallel sizes for this model: 1, 2" in three.stderr
    assert "Traceback" not in three.stderr and "Uvicorn running" not in three.stdout + three.stderr
    zero = serve("--tensor-parallel", "0")
    assert zero.returncode == 2 and "argument --tensor-parallel: must be >= 1, got 0" in zero.stderr
    with pytest.raises(ConfigError, match=r"\[models.m\] tensor_parallel must be an integer >= 1.*got 0"):
        parse_config({"models": {"m": {"source": str(tp_dir), "tensor_parallel": 0}}})
    two = {"source": str(tp_dir), "tensor_parallel": 2}
    with pytest.raises(ConfigError, match="models a, b all set tensor_parallel > 1"):
        parse_config({"models": {"a": two, "b": two}})
    encoder = parse_config({"models": {"e": {"source": "all-minilm-l6-v2", "tensor_parallel": 2}}})
    with pytest.raises(ConfigError, match="all-minilm-l6-v2 is an embedding model"):
        create_app(encoder)


def test_a_follower_that_dies_fails_its_model_only(server, client, reference):
    """Last: it takes the module's server down to `plain`. The follower stops (SIGSTOP) so that a
    request is certainly inside a step, waiting on it; then it is killed: rank 0's collective
    fails with ParallelError instead of hanging, and the request gets a 503 saying so."""
    (follower,) = _follower_pids(server.proc.pid)
    os.kill(follower, signal.SIGSTOP)
    answer = {}

    def request():
        try:
            client.completions.create(model="tp", prompt=PROMPTS[0], max_tokens=8, temperature=0)
            answer["error"] = None
        except openai.APIStatusError as e:
            answer["error"] = e

    t = threading.Thread(target=request)
    t.start()
    deadline = time.time() + 30
    while metrics_values(server.url, "headwise_engine_running").get((("model", "tp"),)) != 1:
        assert time.time() < deadline, "the request never reached the engine"
        time.sleep(0.1)
    time.sleep(0.3)  # inside the step: rank 0 waits in the all-reduce for the stopped follower
    assert t.is_alive()
    os.kill(follower, signal.SIGKILL)
    t.join(timeout=20)
    assert not t.is_alive(), "the request hangs after the follower died"
    error = answer["error"]
    assert error is not None and error.status_code == 503, error
    message = error.body["message"]
    assert "tensor-parallel group of 2 processes failed" in message and "ParallelError: rank 0 of 2" in message
    assert "rank 1 of 2 was killed by SIGKILL" in message

    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "degraded" and health["models"] == {"tp": "failed", "plain": "ready"}
    assert "rank 1 of 2 was killed by SIGKILL" in health["errors"]["tp"]
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tp", prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert e.value.status_code == 503 and e.value.body["code"] == "model_unavailable"
    assert "rank 1 of 2 was killed by SIGKILL" in e.value.body["message"]

    ref = headwise.generate(reference, PROMPTS[1], max_new_tokens=8, temperature=0)
    out = client.completions.create(model="plain", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert "Traceback" not in server.log()
