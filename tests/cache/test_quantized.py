"""int8 K/V: quantization error, bytes per token, and attention error through the layer.

Stated bound: attention outputs through an int8 cache differ from the fp32 answer
by at most 2e-2 of the output's largest magnitude (max |out - ref| <= 2e-2 *
max |ref|); measured 3e-3 to 7e-3 on these layers.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import MultiHeadAttention
from headwise.cache import ContiguousKVCache, Int8CacheRead, dequantize_int8, kv_bytes_per_token, quantize_int8
from headwise.core.config import ModelConfig, get_preset
from headwise.core.plan import kv_bytes_per_token as planned_bytes

C = 32
REL_BOUND = 2e-2
HEADS = [(4, 4), (4, 2), (4, 1)]


def rel_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@settings(max_examples=50)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 8, 64])),
    scale=st.floats(1e-6, 1e4),
    zero_row=st.booleans(),
)
def test_round_trip_error_is_at_most_half_a_step_per_row(shape, scale, zero_row):
    x = torch.randn(shape) * scale
    if zero_row:
        x[..., 0, :] = 0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], 1)
    assert q.abs().max() <= 127
    back = dequantize_int8(q, s)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((back - x).abs() <= amax / 254 * (1 + 1e-5) + 1e-30).all()  # scale / 2, rounding
    assert torch.isfinite(back).all()
    if zero_row:
        assert (back[..., 0, :] == 0).all()


def test_dequantize_to_a_lower_precision_dtype():
    q, s = quantize_int8(torch.randn(2, 3, 16))
    assert dequantize_int8(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert torch.allclose(dequantize_int8(q, s, torch.bfloat16).float(), dequantize_int8(q, s), rtol=1e-2)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_int8_bytes_per_token_at_most_0_3x_fp32(D):
    fp32 = ContiguousKVCache(2, 3, 4, 16, D)
    int8 = ContiguousKVCache(2, 3, 4, 16, D, kv_dtype="int8")
    assert int8.memory_bytes() / fp32.memory_bytes() <= 0.3
    assert int8.bytes_per_token() == 2 * 2 * 4 * (D + 4)  # K+V, L, Hkv, int8 + fp32 scale


def test_kv_bytes_per_token_agrees_with_the_planner_and_the_cache():
    for cfg in (
        get_preset("llama-2-7b"),
        get_preset("gpt2"),
        ModelConfig(
            "t",
            "llama",
            vocab_size=10,
            d_model=64,
            num_layers=2,
            num_heads=8,
            d_ff=64,
            max_positions=64,
            num_kv_heads=2,
        ),
    ):
        for name in ("fp32", "bf16", "fp16"):
            assert kv_bytes_per_token(cfg, name) == planned_bytes(cfg, name)
        scales = 2 * cfg.num_layers * cfg.num_kv_heads * 4
        assert kv_bytes_per_token(cfg, "int8") == planned_bytes(cfg, "int8") + scales
        assert kv_bytes_per_token(cfg, torch.int8) == kv_bytes_per_token(cfg, "int8")
        assert kv_bytes_per_token(cfg, torch.float32) == planned_bytes(cfg, "fp32")
        if cfg.head_dim >= 20:  # the scale is 4 bytes next to D: (D + 4) / 4D <= 0.3
            assert kv_bytes_per_token(cfg, "int8") <= 0.3 * kv_bytes_per_token(cfg, "fp32")
    cfg = ModelConfig(
        "t", "llama", vocab_size=10, d_model=64, num_layers=2, num_heads=8, d_ff=64, max_positions=64, num_kv_heads=2
    )
    cache = ContiguousKVCache(2, 3, 2, 16, 8, kv_dtype="int8")
    assert cache.memory_bytes() == kv_bytes_per_token(cfg, "int8") * 3 * 16


def test_update_defers_dequantization_to_attend():
    cache = ContiguousKVCache(1, 1, 2, 8, 16, kv_dtype="int8")
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    read = cache.update(k, v)
    assert isinstance(read, Int8CacheRead) and read.k_q.dtype == torch.int8
    assert read.k.dtype == torch.float32 and rel_err(read.k, k) <= 1 / 127 and rel_err(read.v, v) <= 1 / 127
    q = torch.randn(1, 4, 3, 16)
    from headwise import attend

    assert rel_err(read.attend(q, is_causal=True), attend(q, k, v, is_causal=True)) <= REL_BOUND


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=["mha", "gqa", "mqa"])
def test_decoding_through_int8_stays_within_the_bound(H, Hkv, rope, static):
    torch.manual_seed(0)
    m = MultiHeadAttention(C, H, Hkv, rope=rope).eval()
    x = torch.randn(2, 24, C)
    cache = ContiguousKVCache(1, 2, Hkv, 32, m.head_dim, kv_dtype="int8", static=static)
    fp32 = ContiguousKVCache(1, 2, Hkv, 32, m.head_dim, static=static)
    with torch.no_grad():
        full = m(x, is_causal=True)
        outs = {}
        for name, c in (("int8", cache), ("fp32", fp32)):
            outs[name] = torch.cat(
                [m(x[:, :7], is_causal=True, cache=c)]
                + [m(x[:, t : t + 1], is_causal=True, cache=c) for t in range(7, 24)],
                dim=1,
            )
    assert rel_err(outs["fp32"], full) <= 1e-5
    assert rel_err(outs["int8"], outs["fp32"]) <= REL_BOUND
    assert rel_err(outs["int8"], full) <= REL_BOUND


def test_ragged_padded_batch_through_int8_stays_within_the_bound():
    torch.manual_seed(0)
    m = MultiHeadAttention(C, 4, 2, rope=True).eval()
    lengths = [6, 2, 9]
    xs = [torch.randn(L + 3, C) for L in lengths]
    prompt = torch.randn(3, 9, C)
    for b, L in enumerate(lengths):
        prompt[b, :L] = xs[b][:L]
    kpm = torch.arange(9)[None, :] >= torch.tensor(lengths)[:, None]
    cache = ContiguousKVCache(1, 3, 2, 16, 8, kv_dtype="int8")
    with torch.no_grad():
        y = m(prompt, is_causal=True, key_padding_mask=kpm, cache=cache)
        steps = [
            m(torch.stack([x[L + i] for x, L in zip(xs, lengths)])[:, None], is_causal=True, cache=cache)
            for i in range(3)
        ]
        for b, L in enumerate(lengths):
            got = torch.cat([y[b, :L], *[s[b] for s in steps]])
            assert rel_err(got, m(xs[b][None], is_causal=True)[0]) <= REL_BOUND


def test_int8_cache_checks_the_compute_dtype():
    cache = ContiguousKVCache(1, 1, 1, 8, 4, kv_dtype="int8")
    with pytest.raises(TypeError, match="k has dtype torch.float16 but this cache holds torch.float32"):
        cache.update(torch.randn(1, 1, 1, 4).half(), torch.randn(1, 1, 1, 4).half())
