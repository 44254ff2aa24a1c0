"""PyTorch's fused `scaled_dot_product_attention`: flash / memory-efficient /
cuDNN kernels on GPU, a flash kernel on CPU. GQA is passed grouped
(`enable_gqa=True`), which on CPU is 14x faster for decoding than expanding
K/V (measured here at H=32, Hkv=8, S=4096) and never copies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv import fold_heads, unfold_heads
from ..masks import tile_masks
from ..spec import AttentionOutput, AttentionSpec

_CPU_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _mask_for(spec: AttentionSpec, q) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(mask for SDPA, allowed, is_causal). SDPA's own is_causal is top-left aligned,
    which equals ours only when T == S, so other cases get an explicit mask."""
    only_causal = (
        spec.is_causal
        and spec.window is None
        and spec.attn_mask is None
        and spec.key_padding_mask is None
        and spec.alibi_slopes is None
    )
    if only_causal and spec.T == spec.S:
        return None, None, True
    if not spec.has_mask and spec.alibi_slopes is None:
        return None, None, False
    allowed, bias = tile_masks(spec, 0, spec.T, 0, spec.S, q.device)
    if bias is None:
        return allowed, allowed, False
    mask = bias.to(q.dtype)
    if allowed is not None:
        mask = mask.masked_fill(~allowed, float("-inf"))
    return mask, allowed, False


def sdpa_attention(q, k, v, spec: AttentionSpec) -> AttentionOutput:
    mask, allowed, is_causal = _mask_for(spec, q)
    gqa = spec.H != spec.Hkv  # enable_gqa needs torch >= 2.5, our minimum
    lse = None
    if spec.return_lse:
        if mask is not None and mask.dtype == torch.bool:  # this op wants an additive mask
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out, lse = _CPU_FLASH_LSE(q, k, v, 0.0, is_causal, attn_mask=mask, scale=spec.scale)
        lse = lse.float()
    elif gqa and mask is None and not is_causal:
        # No mask (a decode step, or attention without one): the G query heads of a KV head are
        # G*T rows against that one head (fold_heads), so each KV head is read once, not G
        # times. Measured in SmolLM2's decode (30 layers, 2 threads): 2.2 vs 3.1 ms a token.
        out = F.scaled_dot_product_attention(fold_heads(q, spec.Hkv), k, v, dropout_p=spec.dropout_p, scale=spec.scale)
        out = unfold_heads(out, spec.H)
    else:
        kwargs = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=spec.dropout_p, is_causal=is_causal, scale=spec.scale, **kwargs
        )
    if allowed is not None and (lse is not None or q.device.type != "cpu"):
        # CPU kernels already give zeros for fully masked rows (checked in tests); GPU
        # kernels differ by version, and the CPU op reports LSE 0 there instead of -inf.
        dead = ~allowed.any(dim=-1)  # (B|1, H|1, T)
        out = out.masked_fill(dead[..., None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(dead.expand_as(lse), float("-inf"))
    return AttentionOutput(out, lse, None)


def sdpa_check(q, k, v, spec: AttentionSpec) -> list[str]:
    reasons = []
    if spec.need_weights:
        reasons.append("returns no weights (use backend='math', or return_lse with weights_from_lse)")
    if spec.return_lse:
        if q.device.type != "cpu" or _CPU_FLASH_LSE is None:
            reasons.append("returns LSE only through PyTorch's CPU flash kernel")
        if spec.dropout_p > 0:
            reasons.append("returns LSE only without dropout")
    if spec.softcap is not None:
        reasons.append("no soft-capping (the fused op softmaxes the scores it makes; chunked caps them per tile)")
    if spec.alibi_slopes is not None and q.dtype in (torch.float16, torch.bfloat16):
        # The bias would be rounded to the input dtype: slope * distance loses ~3 digits.
        reasons.append(f"ALiBi bias would be rounded to {q.dtype}")
    return reasons
