"""A model served with `headwise serve MODEL --served-model-name --max-model-len --kv-dtype --max-num-seqs`
honours them: its names in GET /v1/models and in requests, its context cap as OpenAI's 400, its engine's
pool and limits (what the flags' ServeConfig says, seen on the running engine)."""

import argparse

import httpx
import pytest

from headwise.cli.serve_flags import add_model_flags, apply_model_flags
from headwise.serve import create_app
from headwise.serve.config import models_config

from .conftest import LiveServer


@pytest.fixture
def flagged(tiny_dir, monkeypatch):
    monkeypatch.delenv("HEADWISE_API_KEYS", raising=False)  # open API
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*")
    p.add_argument("--config")
    add_model_flags(p)
    args = p.parse_args(
        [str(tiny_dir), "--served-model-name", "tiny-chat,gpt-x", "--max-model-len", "40"]
        + ["--kv-dtype", "int8", "--max-num-seqs", "2"]
    )
    app = create_app(apply_model_flags(models_config(args.models), args))
    live = LiveServer(app).start()
    yield live, app.state.serve, tiny_dir.resolve().name
    live.stop()


def test_a_served_model_honours_its_flags(flagged):
    live, state, folder = flagged
    with httpx.Client(base_url=live.url, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-chat", "gpt-x"]
        for name in ("tiny-chat", "gpt-x"):  # the name and its alias both answer
            r = client.post("/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
        # the tiny model's own context is 256 tokens: only --max-model-len 40 refuses ~100
        r = client.post("/v1/completions", json={"model": "gpt-x", "prompt": "hello " * 100, "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "maximum context length is 40 tokens" in error["message"]
        r = client.post("/v1/completions", json={"model": folder, "prompt": "Hello", "max_tokens": 1})
        assert r.status_code == 404  # the folder's own name is not served any more
    engine = state.runtimes["tiny-chat"].engine
    assert engine.cache.kv_dtype == "int8"  # the pool the engine allocated
    assert engine.config.max_num_seqs == 2
    assert state.runtimes["tiny-chat"].max_model_len == 40
    from headwise.cli.serve import kv_pool_line

    assert "each up to 40 tokens" in kv_pool_line(engine, 40)  # the start-up line says the cap


def test_a_cap_over_the_models_context_fails_that_model_in_one_line(tiny_dir):
    """As vLLM refuses a max_model_len over the derived one: the model fails to load, naming both."""
    import dataclasses
    import json

    from headwise.serve.local import LocalRuntime

    context = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    (spec,) = models_config([str(tiny_dir)]).models.values()
    rt = LocalRuntime(dataclasses.replace(spec, max_model_len=context + 1))
    rt.load()
    assert rt.state == "failed"
    assert f"max_model_len = {context + 1:,} is over the model's context of {context:,} tokens" in rt.error
    ok = LocalRuntime(dataclasses.replace(spec, max_model_len=context))  # at the context: served
    ok.load()
    try:
        assert ok.state == "ready" and ok.max_model_len == context
    finally:
        ok.shutdown()
