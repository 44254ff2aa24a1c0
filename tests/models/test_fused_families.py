"""The fused executor runs every family's block spec (issue 40): Qwen3's QK-norm, Phi-3's partial
rotary, Gemma 2's soft-caps and post-norms, Gemma 3's MQA, QK-norm, post-norms, GeGLU, 5 local : 1
global windows with two rotaries, attention scale. Each tiny random checkpoint (test_families's, saved
by transformers) decodes past its window on the fused executor -- decode steps in the C layer stack
where the spec allows, prefills in blocks.fused_layer -- and equals the reference executor (the
modules as written, blocks.ROUTE_ROWS = 0, which test_families checks against transformers)."""

import pytest
import torch

import headwise
from headwise.cache import ContiguousKVCache
from headwise.kernels import layer as kernel_layer
from headwise.models import blocks, executors

from ..helpers import save_hf
from .test_families import FAMILIES, V, random_hf

TOL = 1e-4
# the families whose every layer's decode step the C stack runs: all of them
STACKED = {"mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = save_hf(tmp_path_factory, name, random_hf(name))
        return made[name]

    return get


@pytest.fixture
def ran(monkeypatch):
    """Layers per route: "stack" (kernel_layer.run_stack entries), "fused" (blocks.fused_layer calls)."""
    counts = {"stack": 0, "fused": 0}
    real, real_stack = executors.fused_layer, kernel_layer.run_stack

    def spy(*args, **kwargs):
        counts["fused"] += 1
        return real(*args, **kwargs)

    def spy_stack(steps, x):
        counts["stack"] += len(steps)
        return real_stack(steps, x)

    monkeypatch.setattr(executors, "fused_layer", spy)
    monkeypatch.setattr(kernel_layer, "run_stack", spy_stack)
    return counts


def _ids(B, n, seed=0):
    return torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, prefill, windows, kv_dtype=None):
    """A prefill, then one token at a time: the logits of every step (B, T, V)."""
    cfg = model.config
    B, T = ids.shape
    cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, windows=windows, kv_dtype=kv_dtype)
    outs = [model(ids[:, :prefill], cache=cache)]
    outs += [model(ids[:, t : t + 1], cache=cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(outs, dim=1)


def _reference(fn, *args):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "ROUTE_ROWS", 0)
        return fn(*args)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("B", [1, 2])
@torch.inference_mode()
def test_decode_past_the_window_runs_fused_and_equals_the_reference(saved, ran, name, B):
    """A cache of every key (benchmarks' and llama-bench's way): the windows are the kernel's."""
    model = headwise.load(saved(name))
    L, prefill, T = model.config.num_layers, 10, 24
    ids = _ids(B, T, seed=B)
    got = _decode(model, ids, prefill, None)
    steps = T - prefill
    assert ran["stack"] + ran["fused"] == L * (1 + steps)  # every layer fused: no reference layer ran
    if name in STACKED:
        assert ran["stack"] == L * steps
    want = _reference(_decode, model, ids, prefill, None)
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "gemma2"])
@torch.inference_mode()
def test_decode_over_windowed_rings_runs_fused_and_equals_the_reference(saved, ran, name):
    """generate()'s cache: each windowed layer a ring of its last W keys (cache/sliding.py)."""
    model = headwise.load(saved(name))
    cfg = model.config
    ids = _ids(2, 24, seed=7)
    got = _decode(model, ids, 10, cfg.windows)
    assert ran["stack"] + ran["fused"] == cfg.num_layers * 15
    if name in STACKED:  # rings of W = 8 rows (24 tokens) beside layers of every key, in one call
        assert ran["stack"] == cfg.num_layers * 14
    want = _reference(_decode, model, ids, 10, cfg.windows)
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "phi3", "gemma2"])
@torch.inference_mode()
def test_a_prefill_over_the_kernels_row_limit_equals_the_reference(saved, ran, name):
    """80 rows: oneDNN's matmuls with the kernels' RMSNorm, QK-norm + RoPE, GeGLU and post-norm rows."""
    model = headwise.load(saved(name))
    ids = _ids(1, 80, seed=3)
    got = model(ids)
    assert ran["fused"] == model.config.num_layers
    want = _reference(model, ids)
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
@torch.inference_mode()
def test_quantized_gemma3_stack_equals_its_kernels_one_by_one(saved, ran, weights):
    """Quantized weights (activations quantized to q8 blocks by both routes): the stack and
    blocks.fused_layer, the same kernels called from Python, agree; and both stay near the reference."""
    model = headwise.load(saved("gemma3"), weights=weights)
    ids = _ids(2, 24, seed=5)
    got = _decode(model, ids, 10, None)
    assert ran["stack"] == model.config.num_layers * 14
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executors, "STACK", False)
        one_by_one = _decode(model, ids, 10, None)
    assert (got - one_by_one).abs().max() <= TOL
    want = _reference(_decode, model, ids, 10, None)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("windows", [False, True])
@torch.inference_mode()
def test_int8_cache_decode_in_the_stack_equals_the_fused_layers(saved, ran, name, windows):
    """An int8 KV cache (the kernel quantizes each new key as the cache's quantize_int8 does): the
    stack -- soft-capped scores over widened int8 rows included -- equals blocks.fused_layer over the
    same cache (the same kernels around attention; the modules' F.linear rounds k and v otherwise,
    which can move a value at an int8 rounding tie by one step)."""
    model = headwise.load(saved(name))
    cfg = model.config
    ids = _ids(2, 24, seed=9)
    w = cfg.windows if windows else None
    got = _decode(model, ids, 10, w, "int8")
    assert ran["stack"] == cfg.num_layers * 14
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executors, "STACK", False)
        want = _decode(model, ids, 10, w, "int8")
    assert (got - want).abs().max() <= 2e-5
