"""Attention of a prefill (many queries, causal or unmasked) in one kernel call: prefill_attention.c.

`prefill_attention(q, k, v, scale, causal)` is softmax(q k^T * scale) v with PyTorch's layout,
q (B, H, T, D), k and v (B, Hkv, S, D), the G = H / Hkv query heads of a KV head sharing it
(GQA) without copies; causal is bottom-right aligned (query t sees keys up to t + S - T, a
prefill after a cache), as headwise's masks are. The `prefill` attention backend calls it for
fp32 CPU requests ahead of PyTorch's fused SDPA.

Against `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`, 2 threads, AMD
EPYC Zen 5 (benchmarks/prefill_attention.py, results/zen5/prefill_attention.txt, medians of 9
interleaved rounds): SmolLM2's shape (H 9, Hkv 3, D 64) T=128 0.24 vs 0.66 ms (2.78x), T=512 2.47
vs 6.21 ms (2.51x), T=2048 29.8 vs 48.2 ms (1.62x); Llama-3-8B's (32, 8, 128) 2.56x, 2.82x, 1.73x.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import _ext, kernels_unavailable

MAX_G, MAX_D = 16, 256  # prefill_attention.c's MAX_PG, MAX_PD


def fits(G: int, D: int) -> bool:
    """Whether the kernel takes G query heads per KV head of head_dim D."""
    return 1 <= G <= MAX_G and 8 <= D <= MAX_D and D % 8 == 0


@functools.cache
def prefill_attention_unavailable() -> str | None:
    """None when prefill_attention runs here, else why it does not."""
    why = kernels_unavailable()
    if why is not None:
        return why
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 19, 16), (2, 2, 23, 16), (2, 2, 23, 16)))
    out, lse = prefill_attention_unchecked(q, k, v, 0.25, True, True)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    s = s.masked_fill(~torch.ones(19, 23, dtype=torch.bool).tril(4), float("-inf"))
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    if not (torch.allclose(out, want, atol=1e-4) and torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-4)):
        return "the compiled prefill-attention kernel disagrees with softmax(q k^T) v"
    return None


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    causal: bool = True,
    want_lse: bool = False,
    window_left: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale) v, fp32 on CPU, no autograd. q (B, H, T, D), k, v (B, Hkv, S, D) with
    each row's D floats contiguous (any other strides); causal: query t sees keys [0, t + S - T];
    window_left (with causal): only keys [t + S - T - window_left, t + S - T], a sliding window of
    window_left + 1 keys (Mistral's, Gemma's sliding_window - 1); the key blocks before a query
    block's window are not read. softcap c > 0: scores c * tanh(s / c) before the mask (Gemma 2).
    -> (out (B, H, T, D) contiguous, lse (B, H, T) natural-log LSE of the scaled scores or None)."""
    why = prefill_attention_unavailable()
    if why is not None:
        raise RuntimeError(f"prefill_attention is unavailable: {why}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(
                f"prefill_attention: {name} must be a 4-D fp32 CPU tensor with each row's D floats contiguous; "
                f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"
            )
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or not k.shape[1] or H % k.shape[1]:
        raise ValueError(
            f"prefill_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, Hkv, S, D) with Hkv "
            f"dividing H, for q {tuple(q.shape)}"
        )
    if not fits(H // k.shape[1], D):
        raise ValueError(
            f"prefill_attention: G={H // k.shape[1]} query heads per KV head and head_dim {D} need 1 <= G <= "
            f"{MAX_G}, 8 <= D <= {MAX_D}, D % 8 == 0; use PyTorch's attention for this shape"
        )
    if causal and k.shape[2] < T:
        raise ValueError(f"prefill_attention: causal with {T} queries needs at least as many keys, got {k.shape[2]}")
    if window_left is not None and (not causal or not 0 <= window_left < 2**31 - 2):
        raise ValueError(f"prefill_attention: window_left must be an int >= 0 with causal=True, got {window_left!r}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"prefill_attention: softcap must be a finite number > 0 or None, got {softcap!r}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return prefill_attention_unchecked(q, k, v, scale, causal, want_lse, window_left, softcap)


def prefill_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    want_lse: bool,
    window_left: int | None = None,
    softcap: float | None = None,
    tokens_first: bool = False,
):
    """prefill_attention for a caller that has checked what it checks (the `prefill` and `paged`
    backends): the kernel call alone. tokens_first: out is a (B, H, T, D) view of a (B, T, H, D)
    tensor, so a layer's `out.transpose(1, 2).reshape(B, T, H * D)` before its output projection
    is a view, not a copy (the kernel writes any row strides)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty(B, T, H, D).transpose(1, 2) if tokens_first else torch.empty(B, H, T, D)
    lse = torch.empty(B, H, T) if want_lse else None
    rc = _ext()[0].prefill_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        B,
        H,
        Hkv,
        T,
        S,
        D,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        scale,
        0 if not causal else 1 if window_left is None else 2 + int(window_left),  # prefill_attention.c's causal
        0.0 if softcap is None else float(softcap),
    )
    if rc:
        raise RuntimeError(
            f"prefill_attention kernel failed (code {rc}: -1 no memory, 1 a shape it does not take: "
            f"H={H}, Hkv={Hkv}, T={T}, S={S}, D={D})"
        )
    return out, lse
