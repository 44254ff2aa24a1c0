"""The `decode` backend: headwise's CPU kernel for queries that see every key (a decode step).

A decode step's attention is a few query rows per KV head against the whole cache: no mask,
and the G query heads of a KV group are G*T rows against it (`fold_heads`). The kernel
(headwise/kernels/csrc/*/decode_attention.c, through kernels/attention.py) reads K and V once in one
pass with an online softmax, straight from the cache's views; PyTorch's flash op gets there
through its general tiling, allocations and a parallel region per call, which for so few rows
is most of the time (SmolLM2's decode on AMD EPYC Zen 3: see benchmarks/decode.py).

It serves fp32 CPU requests with no mask (causal with one query row sees every key; a window
then means the last keys only, read as a view from there), soft-capped or not (Gemma 2: the
kernel caps the scores before its softmax), no ALiBi,
no dropout, no weights, G*T <= 16 rows per KV head and head_dim a multiple of 8 up to 256;
`explain()` names what else it refuses. Ahead of `sdpa` in the auto order.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...kernels import attention as kernel_attention
from ..kv import fold_heads, unfold_heads
from ..spec import AttentionOutput, AttentionSpec


def decode_attention(q, k, v, spec: AttentionSpec) -> AttentionOutput:
    """q (B, H, T, D), k/v (B, Hkv, S, D) -> out (B, H, T, D) (lse (B, H, T) with return_lse)."""
    scale = 1.0 / math.sqrt(spec.D) if spec.scale is None else float(spec.scale)
    rows = fold_heads(q, spec.Hkv).contiguous()  # (B, Hkv, G*T, D)
    if spec.window is not None:  # one query row (decode_check): its window is the last left + 1 keys
        first = max(0, spec.S - 1 - spec.window[0])
        k, v = k[:, :, first:], v[:, :, first:]  # views: the kernel never reads the keys before
    # decode_check (run once per kind of request: attend() memoizes the choice on shapes, dtypes
    # and the K/V layout) has checked everything the kernel's own wrapper would
    out, lse = kernel_attention.decode_attention_all_keys(rows, k, v, scale, spec.return_lse, spec.softcap)
    out = unfold_heads(out, spec.H)  # (B, H, T, D)
    if lse is not None:
        lse = unfold_heads(lse[..., None], spec.H)[..., 0]  # (B, H, T)
    return AttentionOutput(out, lse, None)


def cpu_kernel_reasons(q, k, v, unavailable: Callable[[], str | None]) -> list[str]:
    """What rules out any of headwise's CPU attention kernels (decode, prefill): tracing, a kernel
    not built or not usable here (`unavailable()`: why; not called under torch.compile, which
    would trace into the extension's loading), tensors that are not fp32 on the CPU."""
    if torch.compiler.is_compiling():
        return ["not under torch.compile (the kernel is a C call the compiler cannot trace)"]
    why = unavailable()
    reasons = [] if why is None else [f"kernel unavailable: {why}"]
    if q.device.type != "cpu" or not (q.dtype == k.dtype == v.dtype == torch.float32):
        reasons.append("fp32 CPU tensors only")
    return reasons


def plain_spec_reasons(spec: AttentionSpec) -> list[str]:
    """What neither CPU kernel computes: ALiBi, dropout, weights."""
    return [
        why
        for why, bad in (
            ("no ALiBi", spec.alibi_slopes is not None),
            ("no dropout", spec.dropout_p > 0),
            ("returns no weights", spec.need_weights),
        )
        if bad
    ]


def decode_check(q, k, v, spec: AttentionSpec) -> list[str]:
    reasons = cpu_kernel_reasons(q, k, v, kernel_attention.decode_attention_unavailable)
    if torch.compiler.is_compiling():
        return reasons
    if spec.attn_mask is not None or spec.key_padding_mask is not None or (spec.is_causal and spec.T > 1):
        reasons.append("queries must see every key (no mask; causal only with one query row)")
    elif spec.window is not None and spec.T > 1:
        reasons.append("a window only with one query row (its window is then the last keys)")
    reasons += plain_spec_reasons(spec)
    if spec.kv_map is not None or spec.H % spec.Hkv:
        reasons.append("even GQA groups only")
    elif not kernel_attention.fits(spec.G * spec.T, spec.D):
        reasons.append(
            f"G*T = {spec.G * spec.T} rows per KV head and head_dim {spec.D} need <= {kernel_attention.MAX_G} "
            f"rows and head_dim a multiple of 8 up to {kernel_attention.MAX_D}"
        )
    if k.dim() != 4 or k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[-1] != v.shape[-1]:
        reasons.append("K and V must be (B, Hkv, S, D) with each key's D values contiguous, Dv == D")
    return reasons
