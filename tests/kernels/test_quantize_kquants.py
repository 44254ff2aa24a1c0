"""headwise's Q4_K / Q5_K / Q6_K quantizers (kernels/csrc/x86/avx2/quantize_k.c) against ggml's reference
quantizers (ggml-quants.c: quantize_row_q4_K_ref and quantize_row_q5_K_ref with make_qkx2_quants,
quantize_row_q6_K_ref with make_qx_quants), ported below to numpy, float32 in ggml's order of operations and without FMA.
The gguf package has no K-quant quantizer; its dequantizers decode what ours writes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from headwise.kernels import quant

from .test_quant_linear import awkward_weights, qtype

f32 = np.float32


def rint(v):
    return np.rint(v).astype(np.int32)  # ggml's nearest_int: round half to even


def fit_scale_min(x, w, nmax=15, rmin=-1.0, nstep=20):
    """make_qkx2_quants(32, nmax, x, w, L, &the_min, Laux, rmin, 0.1, nstep, false) for sub-blocks x (n, 32)."""
    n = x.shape[0]
    mn, mx = x.min(1), x.max(1)
    sum_w, sum_x = w[:, 0].copy(), w[:, 0] * x[:, 0]
    for i in range(1, 32):
        sum_w, sum_x = sum_w + w[:, i], sum_x + w[:, i] * x[:, i]
    mn = np.minimum(mn, f32(0))
    flat = mx == mn
    rng = np.where(flat, f32(1), mx - mn)
    iscale = f32(nmax) / rng
    scale = f32(1) / iscale
    L = np.clip(rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = np.zeros(n, f32)
    for i in range(32):
        d = scale * L[:, i].astype(f32) + mn - x[:, i]
        best = best + w[:, i] * (d * d)
    for step in range(nstep + 1):
        iscale = ((f32(rmin) + f32(0.1) * f32(step)) + f32(nmax)) / np.where(flat, f32(1), mx - mn)
        lv = np.clip(rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        sl = sl2 = sxl = np.zeros(n, f32)
        for i in range(32):
            wl = w[:, i] * lv[:, i].astype(f32)
            sl, sl2, sxl = sl + wl, sl2 + wl * lv[:, i].astype(f32), sxl + wl * x[:, i]
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Dsafe = np.where(ok, D, f32(1))
        s, m = (sum_w * sxl - sum_x * sl) / Dsafe, (sl2 * sum_x - sl * sxl) / Dsafe
        pos = m > 0
        m = np.where(pos, f32(0), m)
        s = np.where(pos, sxl / np.where(sl2 == 0, f32(1), sl2), s)
        err = np.zeros(n, f32)
        for i in range(32):
            d = s * lv[:, i].astype(f32) + m - x[:, i]
            err = err + w[:, i] * (d * d)
        take = ok & (err < best) & ~flat
        L[take], best[take], scale[take], mn[take] = lv[take], err[take], s[take], m[take]
    L[flat], scale[flat] = 0, f32(0)
    return scale, -mn, L


def ref_q4_k(w: np.ndarray, five: bool = False) -> np.ndarray:
    """quantize_row_q4_K_ref, or quantize_row_q5_K_ref (five)."""
    nmax = 31 if five else 15
    x = w.astype(f32).reshape(-1, 8, 32)
    nb = x.shape[0]
    sub = x.reshape(-1, 32)
    sum_x2 = np.zeros(sub.shape[0], f32)
    for i in range(32):
        sum_x2 = sum_x2 + sub[:, i] * sub[:, i]
    av = np.sqrt(sum_x2 / f32(32))
    scales, mins, fitted = fit_scale_min(sub, av[:, None] + np.abs(sub), *((31, -0.5, 15) if five else ()))
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = np.maximum(scales.max(1), f32(0)), np.maximum(mins.max(1), f32(0))
    inv_s = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_m = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    ls = np.minimum(rint(inv_s[:, None] * scales).astype(np.uint8), 63).astype(np.int32)
    lm = np.minimum(rint(inv_m[:, None] * mins).astype(np.uint8), 63).astype(np.int32)
    sc = np.zeros((nb, 12), np.int32)
    sc[:, 0:4], sc[:, 4:8] = ls[:, :4], lm[:, :4]
    sc[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    sc[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    sc[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d16, dmin16 = (max_scale / f32(63)).astype(np.float16), (max_min / f32(63)).astype(np.float16)
    dj = d16.astype(f32)[:, None] * ls.astype(f32)  # the 6-bit values read back = ls, lm
    mj = dmin16.astype(f32)[:, None] * lm.astype(f32)
    live = dj != 0  # where a sub-block's scale rounds to 0, its levels stay the fit's (ggml's `continue`)
    q = (x + mj[..., None]) / np.where(live, dj, f32(1))[..., None]
    L = np.where(live[..., None], np.clip(rint(q), 0, nmax), fitted.reshape(nb, 8, 32))
    L = L.reshape(nb, 4, 2, 32)  # 64 values per 32 bytes: the first 32 low nibbles, the next 32 high
    qs = ((L[:, :, 0] & 15) | ((L[:, :, 1] & 15) << 4)).reshape(nb, 128)
    head = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8)], 1).reshape(nb, 4)
    parts = [head, sc.astype(np.uint8)]
    if five:  # value l of sub-block j: bit j of qh[l]
        qh = sum((L.reshape(nb, 8, 32)[:, j] >> 4) << j for j in range(8))
        parts.append(qh.astype(np.uint8))
    return np.concatenate([*parts, qs.astype(np.uint8)], 1)


def fit_scale_signed(x):
    """make_qx_quants(16, 32, x, L, rmse_type=1, NULL) for sub-blocks x (n, 16)."""
    n = x.shape[0]
    ax = np.abs(x)
    idx = ax.argmax(1)  # the first of equal maxima, as ggml's strict >
    amax, mx = ax[np.arange(n), idx], x[np.arange(n), idx]
    zero = amax < f32(1e-15)
    mxs = np.where(zero, f32(1), mx)

    def trial(iscale):
        lv = np.clip(rint(iscale[:, None] * x), -32, 31)
        slx = sl2 = np.zeros(n, f32)
        for i in range(16):
            wt, li = x[:, i] * x[:, i], lv[:, i].astype(f32)
            slx, sl2 = slx + (wt * x[:, i]) * li, sl2 + (wt * li) * li
        return lv, slx, sl2

    L, slx, sl2 = trial(f32(-32) / mxs)
    scale = np.where(sl2 != 0, slx / np.where(sl2 != 0, sl2, f32(1)), f32(0))
    best = scale * slx
    for off in [*range(-9, 0), *range(1, 10)]:
        lv, slx, sl2 = trial(-(f32(32) + f32(0.1) * f32(off)) / mxs)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        s = slx / np.where(sl2 > 0, sl2, f32(1))
        L[take], scale[take] = lv[take], s[take]
        best = np.where(take, scale * slx, best)
    L[zero], scale[zero] = -32, f32(0)  # levels 0
    return scale, L + 32


def ref_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.astype(f32).reshape(-1, 16, 16)
    nb = x.shape[0]
    scales, fitted = fit_scale_signed(x.reshape(-1, 16))
    scales = scales.reshape(nb, 16)
    idx = np.abs(scales).argmax(1)
    max_scale = scales[np.arange(nb), idx]
    empty = np.abs(max_scale) < f32(1e-15)
    iscale = f32(-128) / np.where(empty, f32(1), max_scale)
    d16 = (f32(1) / iscale).astype(np.float16)
    sc = np.minimum(rint(iscale[:, None] * scales), 127).astype(np.int8)
    db = d16.astype(f32)[:, None] * sc.astype(f32)
    live = db != 0
    q = np.clip(rint(x / np.where(live, db, f32(1))[..., None]), -32, 31) + 32
    L = np.where(live[..., None], q, fitted.reshape(nb, 16, 16))  # a 0 scale keeps the fit's levels
    L = L.reshape(nb, 2, 4, 32)  # per 128 values: four runs of 32
    ql = np.concatenate([L[:, :, 0] & 15 | (L[:, :, 2] & 15) << 4, L[:, :, 1] & 15 | (L[:, :, 3] & 15) << 4], 2)
    qh = L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6
    out = np.concatenate(
        [ql.reshape(nb, 128).astype(np.uint8), qh.reshape(nb, 64).astype(np.uint8), sc.view(np.uint8),
         d16[:, None].view(np.uint8)],
        1,
    )  # fmt: skip
    out[empty] = 0
    return out


REFERENCE = {"q4_k": ref_q4_k, "q5_k": lambda w: ref_q4_k(w, five=True), "q6_k": ref_q6_k}


def kquant_weights(O, I):
    """awkward_weights' specials (zero blocks, a lone negative maximum, .5 ties) plus wide ranges,
    all-positive and all-negative super-blocks, a constant sub-block and tiny values."""
    w = awkward_weights(O, I)
    g = torch.Generator().manual_seed(O * 7 + I)
    if O > 3:
        w[3] = torch.randn(I, generator=g).abs() + 0.5  # every value positive: min clamps to 0
        w[4, :256] = -torch.rand(256, generator=g) - 0.1
        w[4, 256:] = torch.randn(I - 256, generator=g) ** 3 * 50
    if O > 5:
        w[5, :32] = 0.25  # constant sub-block
        w[5, 32:] = torch.randn(I - 32, generator=g) * 1e-6
    return w


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("O,I", [(3, 256), (7, 512), (64, 1536)])
def test_kquants_equal_ggmls_reference_bit_for_bit(fmt, O, I):
    w = kquant_weights(O, I)
    want = REFERENCE[fmt](w.numpy()).reshape(O, -1)
    got = quant.quantize(w, fmt)
    assert got.shape == (O, I // 256 * quant.FORMATS[fmt][2])
    same = (got.numpy().reshape(-1, quant.FORMATS[fmt][2]) == want.reshape(-1, quant.FORMATS[fmt][2])).all(1)
    assert same.all(), f"{(~same).sum()} of {same.size} blocks differ, first {np.flatnonzero(~same)[:5]}"


@pytest.mark.parametrize("threads", [1, 2])
def test_kquants_decode_close_and_do_not_depend_on_threads(threads):
    """gguf's own dequantizers read our blocks back within a step of each format, Q4_K closer than
    Q4_1 and Q5_K than Q5_1 (their mins and scales fit by least squares), Q6_K than Q5_0; and the
    bytes do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(96, 2048, generator=torch.Generator().manual_seed(5)) * 0.02
        rel = {}
        for fmt in ("q4_k", "q5_k", "q6_k", "q4_1", "q5_1", "q5_0"):
            blocks = quant.quantize(w, fmt)
            back = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype(fmt))).reshape(w.shape)
            rel[fmt] = ((back - w).norm() / w.norm()).item()
            if fmt in REFERENCE:
                assert torch.equal(blocks, torch.from_numpy(REFERENCE[fmt](w.numpy()).reshape(blocks.shape)))
        assert rel["q4_k"] < rel["q4_1"] < 0.1 and rel["q5_k"] < rel["q5_1"] < 0.05, rel
        assert rel["q6_k"] < rel["q5_0"] / 2 < 0.03, rel
    finally:
        torch.set_num_threads(before)


def test_kquant_shapes_are_checked():
    with pytest.raises(ValueError, match="q4_k: in_features=288 is not a positive multiple of its 256-value block"):
        quant.quantize(torch.zeros(2, 288), "q4_k")
