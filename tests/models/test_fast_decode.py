"""The one-token decode fast path (models/fast_decode.py) against Hugging Face transformers
and against headwise's own general forward; and the cases it must leave to the general path."""
import pytest
import torch

import headwise
import headwise.models.llama as llama_mod
from headwise import kernels
from headwise.cache import ContiguousKVCache

from .conftest import hf_checkpoints

import transformers as tf  # noqa: E402  (the independent reference)
tf.logging.set_verbosity_error()

V, TOL = 128, 1e-4
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, vocab_size=V,
              max_position_embeddings=64, initializer_range=0.1)
CONFIGS = {
    "llama-gqa": lambda: (tf.LlamaConfig(**_LLAMA, num_key_value_heads=2), tf.LlamaForCausalLM),
    "llama-mha-bias": lambda: (tf.LlamaConfig(**_LLAMA, num_key_value_heads=8, attention_bias=True, mlp_bias=True),
                               tf.LlamaForCausalLM),
    "llama-mqa-tied": lambda: (tf.LlamaConfig(**_LLAMA, num_key_value_heads=1, tie_word_embeddings=True),
                               tf.LlamaForCausalLM),
    "llama3-rope": lambda: (tf.LlamaConfig(**_LLAMA, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), tf.LlamaForCausalLM),
    "qwen2": lambda: (tf.Qwen2Config(**_LLAMA, num_key_value_heads=2), tf.Qwen2ForCausalLM),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, checkpoint dir), built once per module."""
    return hf_checkpoints(tmp_path_factory, CONFIGS, seed=7)


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the calls that took the fast path."""
    calls = []
    real = llama_mod.decode_step

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(llama_mod, "decode_step", spy)
    return calls


def _ids(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, prefill, B=None):
    """Prefill `prefill` tokens, then one token at a time: the logits of every step, (B, T - prefill, V)."""
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, ids.shape[0], cfg.num_kv_heads, ids.shape[1], cfg.head_dim)
    model(ids[:, :prefill], cache=cache)
    return torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(prefill, ids.shape[1])], dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B", [1, 3, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])   # kernel rows, then modules
@torch.inference_mode()
def test_fast_steps_match_hf_full_forward(saved, fast_calls, name, B):
    hf, path = saved(name)
    model = headwise.load(path)
    ids = _ids(B, 20, seed=B)
    got = _decode(model, ids, prefill=8)
    assert len(fast_calls) == 12                                   # every decode step took the fast path
    want = hf(ids).logits[:, 8:]
    assert got.shape == want.shape and (got - want).abs().max() <= TOL


@torch.inference_mode()
def test_without_the_kernel_the_module_path_matches(saved, fast_calls, monkeypatch):
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    monkeypatch.setattr(kernels, "kernels_unavailable", lambda: "switched off for this test")
    ids = _ids(2, 16, seed=3)
    got = _decode(model, ids, prefill=5)
    assert len(fast_calls) == 11
    assert (got - hf(ids).logits[:, 5:]).abs().max() <= TOL


@torch.inference_mode()
def test_greedy_generate_matches_hf_generate(saved, fast_calls):
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    prompt = _ids(1, 6, seed=9)
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24,
                       min_new_tokens=24, pad_token_id=0)
    got = headwise.generate(model, prompt[0].tolist(), max_new_tokens=24, temperature=0, ignore_eos=True)
    assert fast_calls and got.token_ids == want[0, 6:].tolist()


def _general(model, ids, prefill):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_mod, "fast_decode_applies", lambda *a: False)
        return _decode(model, ids, prefill)


@torch.inference_mode()
def test_even_pruned_model_uses_fast_path_and_matches_general(saved, fast_calls):
    from headwise.analysis.prune import prune_heads
    _, path = saved("llama-gqa")                       # 8 heads, 2 KV heads: groups of 4
    model = headwise.load(path)
    ids = _ids(1, 12, seed=4)
    _decode(model, ids, prefill=4)                     # caches the structure check before pruning
    prune_heads(model, {0: [0, 1, 2, 3]})              # a whole group: still even (4 heads, 1 KV head)
    # The cache must match the pruned layer shapes; build one per layer count of KV heads.
    cfg = model.config
    assert model.layers[0].attn.num_kv_heads == 1 and model.layers[0].attn.kv_map is None
    caches = []
    for run in ("fast", "general"):
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, 12, cfg.head_dim)
        cache.layers[0] = type(cache.layers[0])(1, 1, 12, cfg.head_dim)     # layer 0 has 1 KV head now
        caches.append(cache)
    fast_calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        outs = []
        for run, cache in zip(("fast", "general"), caches):
            if run == "general":
                mp.setattr(llama_mod, "fast_decode_applies", lambda *a: False)
            model(ids[:, :4], cache=cache)
            outs.append(torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(4, 12)], dim=1))
    assert len(fast_calls) == 8
    assert (outs[0] - outs[1]).abs().max() <= TOL


def _applies(model, ids, cache, mask=None):
    from headwise.models.fast_decode import fast_decode_applies
    return fast_decode_applies(model, ids, cache, mask)


def test_cases_left_to_the_general_path(saved):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    cfg = model.config
    one = _ids(2, 1)

    def cache(**kw):
        c = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim, **kw)
        with torch.inference_mode():
            model(_ids(2, 3), cache=c)
        return c
    with torch.inference_mode():
        assert _applies(model, one, cache())                                   # the case it is for
        assert not _applies(model, _ids(2, 2), cache())                        # two new tokens
        assert not _applies(model, one, cache(), torch.ones(2, 1))             # a padding mask
        assert not _applies(model, one, cache(static=True))
        assert not _applies(model, one, cache(kv_dtype="int8"))
        assert not _applies(model, one, None)
        ragged = cache()
        ragged.trim([3, 2])
        assert not _applies(model, one, ragged)
        c = cache()
        model.layers[1].attn.hook = object()                                  # an analysis capture is on
        assert not _applies(model, one, c)
        model.layers[1].attn.hook = None
        handle = model.layers[0].mlp.down.register_forward_hook(lambda *a: None)
        assert not _applies(model, one, c)                                    # a hook it would bypass
        handle.remove()
        assert _applies(model, one, c)
    assert not _applies(model, one, cache())                                   # gradients wanted
    c = cache()
    model.to(torch.bfloat16)                                                   # modules unchanged, weights not
    with torch.inference_mode():
        assert not _applies(model, one, c)


@torch.inference_mode()
def test_forward_hooks_still_run(saved):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    seen = []
    model.layers[1].mlp.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    out = _decode(model, _ids(1, 6), prefill=3)
    assert out.shape == (1, 3, V) and len(seen) == 4                     # prefill + 3 steps, all general
