"""The `prefill` backend: headwise's CPU kernel for many queries, causal or unmasked (a prefill).

A prefill's attention is arithmetic (T x S x D multiply-adds twice per head), not a memory
stream: the kernel (headwise/kernels/csrc/*/prefill_attention.c, through kernels/prefill.py) tiles
each KV head's G query heads as one set of rows against each block of keys, with an online
softmax, and skips the key blocks a causal block of queries cannot see. Against PyTorch's
fused SDPA on SmolLM2's prefill (H 9, Hkv 3, D 64, AMD EPYC Zen 5): 2.5x at 512 tokens.

It serves fp32 CPU requests without autograd whose mask is none or causal alone (bottom-right
aligned, S >= T), right-padded keys without causal (one call per batch row, on its real keys),
or causal within a sliding window (the kernel starts each block of queries at
its window's first key block and masks the keys before each row's window): no mask tensor, other
key padding or ALiBi, no dropout, no weights (soft-capped scores: the kernel caps each block's), even
GQA groups of up to 16 heads, head_dim a multiple of 8 up to 256, each row's D values
contiguous. `explain()` names what else it refuses. After `decode` (which takes the steps
whose queries see every key, T = 1) and ahead of `sdpa` in the auto order.
"""

from __future__ import annotations

import torch

from ...kernels import prefill as kernel_prefill
from ..spec import AttentionOutput, AttentionSpec
from .decode import cpu_kernel_reasons, plain_spec_reasons

# What explain() says when auto takes it: the rule (every request it serves) and why. Interleaved
# against SDPA on the same q, k, v (views of one fused QKV, as the layer hands them), AMD EPYC Zen 4,
# 1 thread, a busy machine: benchmarks/prefill_attention.py --models seed-layer --mask both
# (results/prefill_attention_seed_layer.txt), and T = S = 8-64 on three shapes (1.0-1.7x).
PREFILL_WHY = (
    "fp32 CPU, causal or no mask (or right-padded keys), no autograd or dropout: headwise's kernel, faster "
    "than PyTorch's SDPA wherever measured (the seed layer's B 4, H 12, D 64 at T 512-2048: 1.06-1.23x "
    "unmasked, 1.35-1.86x causal, AMD EPYC Zen 4; SmolLM2's and Llama-8B's shapes at T 128-2048: 1.6-2.8x "
    "causal, Zen 5)"
)


def prefill_attention(q, k, v, spec: AttentionSpec) -> AttentionOutput:
    """q (B, H, T, D), k/v (B, Hkv, S, D) -> out (B, H, T, D) (lse (B, H, T) with return_lse)."""
    left = None if spec.window is None else spec.window[0]  # prefill_check: causal with a window
    # tokens first: the layer's (and a model block's) concatenation of heads before the output
    # projection is then a view (T 2048, B 4, C 768: a 25 MB copy saved)
    lengths = key_lengths(spec)
    if lengths is None:
        out, lse = kernel_prefill.prefill_attention_unchecked(
            q, k, v, spec.scale, spec.is_causal, spec.return_lse, left, spec.softcap, tokens_first=True
        )
        return AttentionOutput(out, lse, None)
    # right-padded keys, no causal mask (prefill_check): each batch row against its real keys only
    B, H, T, D = q.shape
    out = torch.empty(B, T, H, D).transpose(1, 2)  # (B, H, T, D), tokens first as above
    lse = torch.empty(B, H, T) if spec.return_lse else None
    for b, n in enumerate(lengths):
        o, lb = kernel_prefill.prefill_attention_unchecked(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], spec.scale, False, spec.return_lse, None,
            spec.softcap, tokens_first=True,
        )  # fmt: skip
        out[b : b + 1] = o
        if lse is not None:
            lse[b : b + 1] = lb
    return AttentionOutput(out, lse, None)


PADDED_MIN_KEYS = 64


def key_lengths(spec: AttentionSpec) -> list[int] | None:
    """Real keys per batch row where key_padding_mask (B, S) pads only the end of each row (right
    padding, as a batch of encoder inputs is padded); None without one or where it pads elsewhere."""
    kpm = spec.key_padding_mask
    if kpm is None or kpm.device.type != "cpu":
        return None
    n = (~kpm).sum(1)  # (B,) real keys
    return n.tolist() if torch.equal(kpm, torch.arange(kpm.shape[1]) >= n[:, None]) else None


def prefill_check(q, k, v, spec: AttentionSpec) -> list[str]:
    reasons = cpu_kernel_reasons(q, k, v, kernel_prefill.prefill_attention_unavailable)
    if torch.compiler.is_compiling():
        return reasons
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        reasons.append("no autograd (a forward-only kernel; sdpa and math have a backward)")
    if spec.attn_mask is not None:
        reasons.append("causal or no mask only (no mask tensor; key padding only at the end of rows)")
    elif spec.key_padding_mask is not None and (spec.is_causal or key_lengths(spec) is None):
        reasons.append("key padding only at the end of each row (right padding) and without causal")
    elif spec.key_padding_mask is not None and spec.S < PADDED_MIN_KEYS:
        # one kernel call per row: 1.2-1.6x SDPA at S = 64-256, 0.6-0.7x at 16 (B 4-32, H 12, D 32-64;
        # 1 thread, AMD EPYC Zen 4, interleaved)
        reasons.append(f"with key padding, S >= {PADDED_MIN_KEYS} keys (one call per row; SDPA is faster below)")
    if spec.window is not None and not spec.is_causal:
        reasons.append("a window only with causal (the kernel bounds each query's keys on the left)")
    if spec.is_causal and spec.S < spec.T:
        reasons.append(f"causal needs S >= T (got T={spec.T}, S={spec.S})")
    reasons += plain_spec_reasons(spec)
    if spec.kv_map is not None or spec.H % spec.Hkv:
        reasons.append("even GQA groups only")
    elif not kernel_prefill.fits(spec.G, spec.D):
        reasons.append(
            f"G = {spec.G} query heads per KV head and head_dim {spec.D} need G <= {kernel_prefill.MAX_G} and "
            f"head_dim a multiple of 8 up to {kernel_prefill.MAX_D}"
        )
    if (
        k.dim() != 4
        or q.stride(-1) != 1
        or k.stride(-1) != 1
        or v.stride(-1) != 1
        or k.shape[-1] != v.shape[-1]
        or v.shape[-1] != q.shape[-1]
    ):
        reasons.append("q, K and V must be (B, H|Hkv, T|S, D) with each row's D values contiguous, Dv == D")
    return reasons
