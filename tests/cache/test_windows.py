"""Caches shaped by per-layer windows (ContiguousKVCache(windows=...)): windowed layers keep a
ring of their last W tokens, global layers every token.

The oracle is `attend(..., backend="math", is_causal=True, window=W)` over each layer's whole
K/V (kept here, outside the cache), so a ring that dropped a key still needed, or kept one it
must not show, differs from it.
"""

import pytest
import torch

from headwise import attend
from headwise.cache import ContiguousKVCache, SlidingWindowLayerCache, dequantize_int8, quantize_int8
from headwise.core.config import ModelConfig

H, Hkv, D = 4, 2, 8


def gemma3_270m() -> ModelConfig:
    """Gemma 3 270M's shape (HF config.json): 18 layers, 5 local 512-key layers to 1 global,
    MQA (1 KV head), head_dim 256."""
    return ModelConfig(
        name="gemma-3-270m",
        arch="llama",
        vocab_size=262144,
        d_model=640,
        num_layers=18,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        d_ff=2048,
        max_positions=32768,
        mlp="swiglu",
        norm="rmsnorm",
        positions="rope",
        layer_windows=((512,) * 5 + (None,)) * 3,
    )


def drive(cache, windows, chunks, B, seed=0, static=False):
    """Feed random K/V through every layer of `cache` in `chunks` of new tokens; compare each
    layer's output with the math backend over the whole sequence so far. Returns max error."""
    g = torch.Generator().manual_seed(seed)
    full = [[None, None] for _ in windows]  # per layer: all K, V so far (B, Hkv, S, D)
    worst = 0.0
    for T in chunks:
        q = torch.randn(B, H, T, D, generator=g)
        for i, W in enumerate(windows):
            k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
            if static:
                cache.book(T) if i == 0 else None
            out = cache.layer(i).update(k, v).attend(q, is_causal=True, window=W)
            if cache.kv_dtype == "int8":  # the oracle sees K/V as the cache stores them
                k, v = (dequantize_int8(*quantize_int8(x), x.dtype) for x in (k, v))
            K = k if full[i][0] is None else torch.cat([full[i][0], k], 2)
            V = v if full[i][1] is None else torch.cat([full[i][1], v], 2)
            full[i] = [K, V]
            ref = attend(q, K, V, is_causal=True, window=W, backend="math")
            worst = max(worst, (out - ref).abs().max().item())
    return worst


WINDOWS = [None, 3, 5, None, 3]


@pytest.mark.parametrize("chunks", [[1] * 12, [7, 1, 1, 1, 9, 1], [2, 3, 1, 6, 1]], ids=["decode", "long", "mixed"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_windowed_layers_match_the_math_backend(chunks, kv_dtype):
    cache = ContiguousKVCache(len(WINDOWS), 2, Hkv, 40, D, windows=WINDOWS, kv_dtype=kv_dtype)
    assert [type(layer) is SlidingWindowLayerCache for layer in cache.layers] == [w is not None for w in WINDOWS]
    assert drive(cache, WINDOWS, chunks, B=2) <= 1e-5
    assert cache.lengths.tolist() == [sum(chunks)] * 2


def test_static_cache_masks_windows_by_position():
    """A static cache (compiled decode) keeps every slot and masks windowed layers by position."""
    cache = ContiguousKVCache(len(WINDOWS), 2, Hkv, 24, D, windows=WINDOWS, static=True)
    assert all(type(layer) is not SlidingWindowLayerCache for layer in cache.layers)
    assert drive(cache, WINDOWS, [6, 1, 1, 1, 1], B=2, static=True) <= 1e-5


def test_ragged_rows_see_their_own_window():
    """Right-padded rows (num_new) of different lengths: each row's ring holds its own last W."""
    windows = [4, None]
    cache = ContiguousKVCache(2, 2, Hkv, 32, D, windows=windows)
    g = torch.Generator().manual_seed(1)
    lens, full = [9, 5], {}
    T0 = max(lens)
    q = torch.randn(2, H, T0, D, generator=g)
    kv = [(torch.randn(2, Hkv, T0, D, generator=g), torch.randn(2, Hkv, T0, D, generator=g)) for _ in windows]
    outs = [
        cache.layer(i).update(k, v, torch.tensor(lens)).attend(q, is_causal=True, window=W)
        for i, ((k, v), W) in enumerate(zip(kv, windows))
    ]
    for i, W in enumerate(windows):
        for b, n in enumerate(lens):
            k, v = kv[i][0][b : b + 1, :, :n], kv[i][1][b : b + 1, :, :n]
            ref = attend(q[b : b + 1, :, :n], k, v, is_causal=True, window=W, backend="math")
            assert (outs[i][b : b + 1, :, :n] - ref).abs().max() <= 1e-5
            full[i, b] = (k, v)
    for _ in range(6):  # decode steps: rows at different lengths
        q = torch.randn(2, H, 1, D, generator=g)
        for i, W in enumerate(windows):
            k, v = torch.randn(2, Hkv, 1, D, generator=g), torch.randn(2, Hkv, 1, D, generator=g)
            out = cache.layer(i).update(k, v).attend(q, is_causal=True, window=W)
            for b in range(2):
                K = torch.cat([full[i, b][0], k[b : b + 1]], 2)
                V = torch.cat([full[i, b][1], v[b : b + 1]], 2)
                full[i, b] = (K, V)
                ref = attend(q[b : b + 1], K, V, is_causal=True, window=W, backend="math")
                assert (out[b : b + 1] - ref).abs().max() <= 1e-5


def test_the_layer_window_must_be_the_caches():
    cache = ContiguousKVCache(1, 1, Hkv, 16, D, windows=[4])
    q, k = torch.randn(1, H, 2, D), torch.randn(1, Hkv, 2, D)
    with pytest.raises(ValueError, match="window of 8 keys but its cache keeps a window of 4"):
        cache.layer(0).update(k, k).attend(q, is_causal=True, window=8)


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match="windows has 2 entries but the cache has num_layers=3"):
        ContiguousKVCache(3, 1, 1, 8, 4, windows=[None, 2])
    with pytest.raises(ValueError, match=r"windows\[1\] must be None"):
        ContiguousKVCache(2, 1, 1, 8, 4, windows=[None, 0])


def test_no_windows_builds_what_it_built_before():
    """Every layer global: plain contiguous layers, the fused decode's stack claim still offered."""
    cache = ContiguousKVCache(3, 1, 2, 8, 4, windows=[None] * 3)
    plain = ContiguousKVCache(3, 1, 2, 8, 4)
    assert [type(x) for x in cache.layers] == [type(x) for x in plain.layers]
    assert cache.memory_bytes() == plain.memory_bytes()
    assert cache.claim_decode_stack(1, 3) is not None


def test_gemma3_4096_tokens_hold_under_0_3x_the_kv_bytes_of_all_global():
    """Issue 40: a 4,096-token Gemma 3 sequence uses <= 0.3x the KV bytes of the same model with
    every layer global. Measured on the allocated buffers (bf16, as the model computes), against
    the bound from the config: (global layers * 4096 + local layers * 512) / (all layers * 4096)."""
    cfg = gemma3_270m()
    n = 4096
    dims = dict(dtype=torch.bfloat16, device="meta")  # sizes only: no 4096-token buffers allocated
    hybrid = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, windows=cfg.windows, **dims)
    full = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, **dims)
    ratio = hybrid.bytes_per_token() / full.bytes_per_token()
    n_global = sum(w is None for w in cfg.windows)
    bound = (n_global * n + sum(min(w, n) for w in cfg.windows if w is not None)) / (cfg.num_layers * n)
    assert ratio == pytest.approx(bound)  # 0.2708: 3 x 4096 + 15 x 512 token-layers of 18 x 4096
    assert ratio <= 0.3
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    assert full.memory_bytes() == cfg.num_layers * n * per_layer
