"""The `flash-attn` package (Dao et al.) on CUDA: install with `pip install headwise[flash]`.

flash-attn takes (B, T, H, D) tensors, reads GQA K/V grouped, aligns causal masks
bottom-right (>= 2.1), and supports sliding windows and ALiBi natively. It has no
arbitrary masks and no padding masks in this entry point (padding would need its
varlen API), so those requests fall through to the next backend.
"""

from __future__ import annotations

import importlib.util

import torch

from ..spec import AttentionOutput, AttentionSpec

_INSTALLED = importlib.util.find_spec("flash_attn") is not None


def flash_attention(q, k, v, spec: AttentionSpec) -> AttentionOutput:
    from flash_attn import flash_attn_func

    window = spec.window if spec.window is not None else (-1, -1)
    slopes = spec.alibi_slopes
    if slopes is not None and slopes.shape[0] == 1:
        slopes = slopes[0]  # (H,)
    res = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=spec.dropout_p,
        softmax_scale=spec.scale,
        causal=spec.is_causal,
        window_size=window,
        alibi_slopes=slopes,
        return_attn_probs=spec.return_lse,
    )
    if spec.return_lse:
        out, lse, _ = res
        return AttentionOutput(out.transpose(1, 2), lse.float(), None)
    return AttentionOutput(res.transpose(1, 2), None, None)


def flash_check(q, k, v, spec: AttentionSpec) -> list[str]:
    reasons = []
    if not _INSTALLED:
        reasons.append("flash-attn is not installed (pip install 'headwise[flash]')")
    if q.device.type != "cuda":
        reasons.append(f"needs CUDA, tensors are on {q.device.type}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"needs fp16/bf16, got {q.dtype}")
    if spec.D > 256 or v.shape[-1] != spec.D:
        reasons.append(f"needs equal q/k/v head dims <= 256, got {spec.D} and {v.shape[-1]}")
    if spec.attn_mask is not None:
        reasons.append("no arbitrary attn_mask")
    if spec.key_padding_mask is not None:
        reasons.append("no key_padding_mask (needs the varlen API)")
    if spec.need_weights:
        reasons.append("returns no weights")
    if spec.softcap is not None:
        reasons.append("no soft-capping through this entry point (chunked and math cap the scores)")
    return reasons
