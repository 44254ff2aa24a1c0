"""The fused executor (models/executors.py: blocks.fused_layer and the C layer stack) against Hugging
Face transformers and against the reference executor (the modules); and the cases it must leave to the
reference."""

import pytest
import torch

import headwise
from headwise import kernels
from headwise.cache import ContiguousKVCache, PagedKVCache
from headwise.models import blocks
from headwise.models.packing import PackedLinear

from .conftest import hf_checkpoints

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

V, TOL = 128, 1e-4
_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    vocab_size=V,
    max_position_embeddings=64,
    initializer_range=0.1,
)
CONFIGS = {
    "llama-gqa": lambda: (tf.LlamaConfig(**_LLAMA, num_key_value_heads=2), tf.LlamaForCausalLM),
    "llama-mha-bias": lambda: (
        tf.LlamaConfig(**_LLAMA, num_key_value_heads=8, attention_bias=True, mlp_bias=True),
        tf.LlamaForCausalLM,
    ),
    "llama-mqa-tied": lambda: (
        tf.LlamaConfig(**_LLAMA, num_key_value_heads=1, tie_word_embeddings=True),
        tf.LlamaForCausalLM,
    ),
    "llama3-rope": lambda: (
        tf.LlamaConfig(
            **_LLAMA,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        tf.LlamaForCausalLM,
    ),
    "qwen2": lambda: (tf.Qwen2Config(**_LLAMA, num_key_value_heads=2), tf.Qwen2ForCausalLM),
    "gpt2": lambda: (
        tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V, initializer_range=0.3),
        tf.GPT2LMHeadModel,
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, checkpoint dir), built once per module."""
    return hf_checkpoints(tmp_path_factory, CONFIGS, seed=7)


@pytest.fixture
def routed(few_rows):
    """Counts the block steps that took the few-rows route (conftest's few_rows)."""
    return few_rows


def _ids(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, prefill, **cache_kw):
    """Prefill `prefill` tokens, then one token at a time: the logits of every step, (B, T - prefill, V)."""
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, ids.shape[0], cfg.num_kv_heads, ids.shape[1], cfg.head_dim, **cache_kw)
    model(ids[:, :prefill], cache.step(prefill))
    return torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in range(prefill, ids.shape[1])], dim=1)


def _general(fn, *args, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "ROUTE_ROWS", 0)
        return fn(*args, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B", [1, 3, 5, 16])  # the kernel's two tiles (4 x 8 up to 4 rows, 6 x 16 from 5)
@torch.inference_mode()
def test_route_steps_match_hf_full_forward(saved, routed, name, B):
    hf, path = saved(name)
    model = headwise.load(path)
    ids = _ids(B, 20, seed=B)
    got = _decode(model, ids, prefill=8)
    prefill_routed = blocks.ROUTE_ROWS is None or B * 8 <= blocks.ROUTE_ROWS
    assert len(routed) == 2 * (12 + prefill_routed)  # 2 layers x (the prefill if few rows + 12 decode steps)
    want = hf(ids).logits[:, 8:]
    assert got.shape == want.shape and (got - want).abs().max() <= TOL


@torch.inference_mode()
def test_without_the_kernel_the_module_calls_match(saved, routed, monkeypatch):
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    monkeypatch.setattr(kernels, "kernels_unavailable", lambda: "switched off for this test")
    ids = _ids(2, 16, seed=3)
    got = _decode(model, ids, prefill=5)
    assert len(routed) == 2 * 12
    assert (got - hf(ids).logits[:, 5:]).abs().max() <= TOL


@torch.inference_mode()
def test_ragged_rows_take_the_route_and_match_hf(saved, routed):
    """Rows at different lengths (a right-padded prefill, then decodes): the route runs with the
    cache's per-row masks, and each row equals HF on that row alone."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    lengths = [3, 7, 5]
    ids = _ids(3, 7 + 6, seed=5)
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 16, cfg.head_dim)
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    first = model(ids[:, :7], cache=cache, attention_mask=mask)  # (3, 7, V)
    rows = [[*ids[b, :n].tolist()] for b, n in enumerate(lengths)]
    steps = [first[torch.arange(3), torch.tensor(lengths) - 1]]
    for t in range(6):
        nxt = ids[:, 7 + t]
        for b in range(3):
            rows[b].append(int(nxt[b]))
        steps.append(model(nxt[:, None], cache.step(1))[:, 0])
    assert len(routed) == 2 * 7
    for b in range(3):
        want = hf(torch.tensor([rows[b]])).logits[0, lengths[b] - 1 :]  # (7, V)
        got = torch.stack([s[b] for s in steps])
        assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("kw", [{"kv_dtype": "int8"}, {"static": True}])
@torch.inference_mode()
def test_int8_and_static_caches_route_equals_general(saved, routed, kw):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    ids = _ids(2, 14, seed=6)
    got = _decode(model, ids, prefill=4, **kw)
    assert len(routed) == 2 * 11
    want = _general(_decode, model, ids, prefill=4, **kw)
    assert (got - want).abs().max() <= TOL


@torch.inference_mode()
def test_packed_paged_steps_route_equals_hf(saved, routed):
    """The engine's step: two sequences' decodes and a third's prefill chunk packed on one axis,
    logits only at the rows that sample (logits_indices)."""
    hf, path = saved("llama-gqa")
    model = headwise.load(path)
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4)
    seqs = {s: _ids(1, 12, seed=10 + i)[0].tolist() for i, s in enumerate("abc")}
    for s in "ab":
        cache.add_sequence(s)
        step = cache.packed([s], [5])
        model(torch.tensor([seqs[s][:5]]), step)
    cache.add_sequence("c")
    step = cache.packed(["a", "b", "c"], [1, 1, 6], logits_indices=[0, 1, 7])
    ids = torch.tensor([[seqs["a"][5], seqs["b"][5], *seqs["c"][:6]]])
    got = model(ids, step)  # (3, V)
    assert got.shape == (3, V) and len(routed) == 2 * 3
    want = torch.stack(
        [
            hf(torch.tensor([seqs["a"][:6]])).logits[0, -1],
            hf(torch.tensor([seqs["b"][:6]])).logits[0, -1],
            hf(torch.tensor([seqs["c"][:6]])).logits[0, -1],
        ]
    )
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("groups", ["even", "uneven"])
@torch.inference_mode()
def test_pruned_models_take_the_route_and_match_the_general_route(saved, routed, groups):
    from headwise.analysis.prune import prune_heads

    _, path = saved("llama-gqa")  # 8 heads, 2 KV heads: groups of 4
    model = headwise.load(path)
    prune_heads(model, {0: [0, 1, 2, 3] if groups == "even" else [0, 1, 5]})
    attn = model.layers[0].attn
    assert (attn.kv_map is None) == (groups == "even")
    cfg = model.config

    def run():
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, 12, cfg.head_dim)
        cache.layers[0] = type(cache.layers[0])(1, attn.num_kv_heads, 12, cfg.head_dim)  # layer 0's KV heads now
        model(ids[:, :4], cache.step(4))
        return torch.cat([model(ids[:, t : t + 1], cache.step(1)) for t in range(4, 12)], dim=1)

    ids = _ids(1, 12, seed=4)
    got = run()
    assert len(routed) == 2 * 9
    assert (got - _general(run)).abs().max() <= TOL


class _Capture:
    """An analysis hook (the `MultiHeadAttention.hook` slot): sees each call's heads."""

    wants_lse = False

    def __init__(self):
        self.seen = 0

    def __call__(self, module, q, k, v, out, lse, weights, kwargs):
        self.seen += 1
        return out


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-bias", "qwen2"])
@torch.inference_mode()
def test_a_prefill_of_many_rows_takes_the_route_and_matches_hf(saved, routed, monkeypatch, name):
    """More rows than the small-row kernel takes (a prefill): oneDNN's matmuls with RMSNorm, SwiGLU and RoPE
    as the kernels' row calls and the residual as oneDNN's post-op, each of them run; equal to HF."""
    hf, path = saved(name)
    model = headwise.load(path)
    calls = {"rms_norm": 0, "swiglu": 0, "rope_": 0, "forward_add": 0}

    def spy(owner, attr):
        real = getattr(owner, attr)

        def counted(*a, **kw):
            calls[attr] += 1
            return real(*a, **kw)

        monkeypatch.setattr(owner, attr, counted)

    spy(kernels, "rms_norm"), spy(kernels, "swiglu"), spy(kernels, "rope_"), spy(PackedLinear, "forward_add")
    ids = _ids(3, 40, seed=11)  # 120 rows > kernels.MAX_ROWS
    got = _decode(model, ids, prefill=30)  # the prefill (90 rows), then 10 decode steps
    L = model.config.num_layers
    assert len(routed) == L * 11
    # the prefill's: per layer two norms, SwiGLU, RoPE, two residuals; the final norm
    assert calls == {"rms_norm": 2 * L + 1, "swiglu": L, "rope_": L, "forward_add": 2 * L}
    want = hf(ids).logits[:, 30:]
    assert got.shape == want.shape and (got - want).abs().max() <= TOL
    prefill = model(ids)  # a plain forward of all 120 rows, no cache
    assert (prefill - hf(ids).logits).abs().max() <= TOL


def test_cases_left_to_the_general_route(saved, routed, monkeypatch):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    cfg = model.config

    def step_routes(B=2, T=1, train=False) -> bool:
        routed.clear()
        cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, 64, cfg.head_dim)
        model.train(train)
        model(_ids(B, T), cache=cache) if not train else model(_ids(B, T))
        model.eval()
        return len(routed) == cfg.num_layers

    with torch.inference_mode():
        assert step_routes()  # the case it is for
        assert step_routes(B=4, T=16)  # 64 rows: the small-row kernel's
        assert step_routes(B=5, T=13)  # 65 rows, a prefill: oneDNN's matmuls, still the route
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 64)  # a limit set: more rows take the general route
        assert step_routes(B=4, T=16) and not step_routes(B=5, T=13)
        monkeypatch.setattr(blocks, "ROUTE_ROWS", None)
        model.layers[1].attn.hook = _Capture()  # an analysis capture is on: the whole step is the reference
        assert not step_routes() and len(routed) == 0
        assert model.layers[1].attn.hook.seen == 1
        model.layers[1].attn.hook = None
        handle = model.layers[0].mlp.down.register_forward_hook(lambda *a: None)
        assert not step_routes()  # a hook it would bypass
        handle.remove()
        assert step_routes()
    with torch.no_grad():
        assert not step_routes(train=True)  # training mode
    assert not step_routes()  # gradients wanted


@torch.inference_mode()
def test_forward_hooks_still_run(saved):
    _, path = saved("llama-gqa")
    model = headwise.load(path)
    seen = []
    model.layers[1].mlp.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    out = _decode(model, _ids(1, 6), prefill=3)
    assert out.shape == (1, 3, V) and len(seen) == 4  # prefill + 3 steps, all general
