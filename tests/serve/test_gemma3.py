"""`headwise serve GEMMA.gguf smollm2-135m-instruct`: Gemma 3 270M (its Q4_K_M GGUF by path: MQA,
sliding-window and global layers) beside SmolLM2 behind one server, started as users start it
and asked through the official `openai` client. Gemma's answers are checked against
headwise.generate in this process on the same file (tests/models/test_gguf_families.py holds
generate's tokens to transformers' on that file); few tokens, so the module stays fast."""

import subprocess
import sys

import openai
import pytest

import headwise
from headwise.models.builtin import resolve
from headwise.serve.config import models_config

from .conftest import free_port, wait_healthy

PROMPT = "The capital of France is"
N = 6  # tokens per answer


@pytest.fixture(scope="module")
def gguf():
    return resolve("gemma3")  # the builtin's assembled file, served by its path


@pytest.fixture(scope="module")
def gemma(gguf):
    return headwise.load(gguf)  # the server's own load (quantized blocks), for the reference


@pytest.fixture(scope="module")
def server(gguf, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("gemma3-serve") / "serve.log"
    cmd = [sys.executable, "-m", "headwise.cli", "serve", str(gguf), "smollm2-135m-instruct", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def alive():
        assert proc.poll() is None, f"server exited:\n{log.read_text()}"

    try:
        assert wait_healthy(url, 240, alive), log.read_text()
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_builtin_names_are_served_under_their_own_names():
    config = models_config(["gemma3", "smollm2-135m-instruct"])
    assert config.model_names() == ["gemma3-270m", "smollm2-135m-instruct"]
    assert config.models["gemma3-270m"].source == "gemma3"


def test_both_models_are_listed(server, gguf):
    ids = [m.id for m in server.models.list()]
    assert ids == [gguf.stem, "smollm2-135m-instruct"]  # a GGUF path is served under its file's stem


def test_gemma_completions_equal_generate(server, gguf, gemma):
    ref = headwise.generate(gemma, PROMPT, max_new_tokens=N, temperature=0)
    assert len(ref.token_ids) == N
    res = server.completions.create(model=gguf.stem, prompt=PROMPT, max_tokens=N, temperature=0)
    assert res.choices[0].text == ref.text and res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ref.prompt_token_ids), N)
    chunks = list(server.completions.create(model=gguf.stem, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_gemma_chat_without_a_template_names_the_fix(server, gguf, gemma):
    assert gemma.tokenizer.chat_template is None  # the GGUF carries none: nothing to render messages with
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            server.chat.completions.create(
                model=gguf.stem, messages=[{"role": "user", "content": "Hi"}], max_tokens=N, stream=stream
            )
        err = e.value.body
        assert err["code"] == "no_chat_template" and err["param"] == "model"
        assert "has no chat template" in err["message"] and "/v1/completions" in err["message"]


def test_smollm2_chat_beside_gemma(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    res = server.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=N, temperature=0)
    text = res.choices[0].message.content
    assert text and res.usage.completion_tokens == N and res.choices[0].finish_reason == "length"
    chunks = list(
        server.chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=N, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # greedy: the same
    res = server.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=N, temperature=0)
    assert res.choices[0].text and res.usage.completion_tokens == N
