"""The reference: materialize scores, mask, softmax, weighted sum. Short and
obviously right; every other backend and every cache is tested against it.

Low-precision inputs are computed in fp32 and rounded once at the end, so the
reference is the exact answer rounded to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv import fold_heads, unfold_heads
from ..masks import tile_masks
from ..spec import AttentionOutput, AttentionSpec, soft_cap


def math_attention(q, k, v, spec: AttentionSpec) -> AttentionOutput:
    B, H, T, D = q.shape
    Hkv, S = spec.Hkv, spec.S
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()

    # GQA without copying K/V: query heads of one group share a KV head, so fold the
    # group into the row dim: (B, Hkv, G*T, D) @ (B, Hkv, D, S). Head h = kv * G + g.
    scores = fold_heads(q * spec.scale, Hkv) @ k.transpose(-2, -1)  # (B, Hkv, G*T, S)
    scores = soft_cap(unfold_heads(scores, H), spec.softcap)  # (B, H, T, S)
    allowed, bias = tile_masks(spec, 0, T, 0, S, q.device)
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))

    weights = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1) if spec.return_lse else None  # (B, H, T)
    if allowed is not None or bias is not None:  # fully masked rows: zeros, not NaN
        dead = torch.isneginf(lse) if lse is not None else torch.isneginf(scores.amax(dim=-1))
        weights = weights.masked_fill(dead[..., None], 0.0)
    if spec.dropout_p > 0:
        weights = F.dropout(weights, spec.dropout_p)
    out = fold_heads(weights, Hkv) @ v  # (B, Hkv, G*T, Dv)
    out = unfold_heads(out, H).to(dtype)  # (B, H, T, Dv)
    return AttentionOutput(out, lse, weights.to(dtype) if spec.need_weights else None)


def math_check(q, k, v, spec: AttentionSpec) -> list[str]:
    return []  # the reference serves everything
