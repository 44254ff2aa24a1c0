"""Checks of a read of a paged cache: `paged_spec` turns q and a cache's description
(`headwise.attention.kv`: `BlockReads` for a padded step, `PackedReads` for a packed one)
into an `AttentionSpec`, and every error names the fix; `paged_check` says why the `paged`
backend cannot serve a spec (weights, dropout). The reading itself is in paged.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kv import LayerKV, PackedReads
from ..spec import AttentionSpec, _check_attn_mask, _check_window, check_softcap, window_covers_all


def paged_spec(
    q: Tensor,
    kv: LayerKV,
    *,
    attn_mask=None,
    key_padding_mask=None,
    is_causal=False,
    kv_map=None,
    alibi_slopes=None,
    scale=None,
    dropout_p=0.0,
    need_weights=False,
    return_lse=False,
    window=None,
    softcap=None,
) -> AttentionSpec:
    """Check a read of `kv` by q against the cache's description; every error names the fix."""
    reads = kv.reads
    if isinstance(reads, PackedReads):
        return _packed_spec(
            q,
            reads,
            attn_mask,
            key_padding_mask,
            is_causal,
            kv_map,
            alibi_slopes,
            scale,
            dropout_p,
            need_weights,
            return_lse,
            window,
            softcap,
        )
    B, T, S, Hkv, D = reads.B, reads.T, reads.S, reads.num_kv_heads, reads.head_dim
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != B or q.shape[2] != T or q.shape[3] != D:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be (B, H, T, D) = ({B}, H, {T}, {D}), got {got}")
    H = q.shape[1]
    if kv_map is None and H % Hkv:
        raise ValueError(f"num_heads={H} (q) is not divisible by num_kv_heads={Hkv} (cache)")
    if kv_map is not None:
        kv_map = kv_map.to(q.device)
        if tuple(kv_map.shape) != (H,) or int(kv_map.min()) < 0 or int(kv_map.max()) >= Hkv:
            raise ValueError(
                f"kv_map must be (H,) = ({H},) KV head indices in [0, {Hkv}), "
                f"got {tuple(kv_map.shape)} {kv_map.tolist()}"
            )
    if q.dtype != reads.dtype:
        raise TypeError(f"q has dtype {q.dtype} but this cache holds {reads.dtype}")
    if window is not None:  # at each query's true position (starts[b] + t), keys by position
        window = _check_window(window, is_causal)
        if window_covers_all(window, is_causal, T, S):
            window = None
    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, B, H, T, S, q)
    if key_padding_mask is not None and (
        tuple(key_padding_mask.shape) != (B, S) or key_padding_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"key_padding_mask must be bool (B, S) = ({B}, {S}) over the padded key axis "
            f"(S = longest sequence after this step), got {tuple(key_padding_mask.shape)} "
            f"{key_padding_mask.dtype}"
        )
    alibi_slopes = _check_alibi(alibi_slopes, B, H, q)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return AttentionSpec(
        B,
        H,
        Hkv,
        T,
        S,
        D,
        scale,
        attn_mask,
        key_padding_mask,
        bool(is_causal),
        window,
        alibi_slopes,
        float(dropout_p),
        bool(need_weights),
        bool(return_lse),
        kv_map,
        check_softcap(softcap),
    )


def _packed_spec(
    q,
    reads: PackedReads,
    attn_mask,
    key_padding_mask,
    is_causal,
    kv_map,
    alibi_slopes,
    scale,
    dropout_p,
    need_weights,
    return_lse,
    window,
    softcap,
) -> AttentionSpec:
    N, D = reads.N, reads.head_dim
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != N or q.shape[3] != D:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be (1, H, N, D) = (1, H, {N}, {D}) for this packed step, got {got}")
    if attn_mask is not None or key_padding_mask is not None:
        raise ValueError(
            "a packed step takes no attn_mask or key_padding_mask: each token already sees "
            "only its own sequence; use PagedKVCache.batch for custom masks"
        )
    if need_weights:
        raise ValueError("a packed read returns no weights; use PagedKVCache.batch with backend='math'")
    # Each part is checked again against its own read plan (kv_map, dtype, ALiBi, window).
    s = None if scale is None else float(scale)
    window = None if window is None else _check_window(window, is_causal)
    return AttentionSpec(
        1,
        q.shape[1],
        reads.num_kv_heads,
        N,
        N,
        D,
        s,
        None,
        None,
        bool(is_causal),
        window,
        alibi_slopes,
        float(dropout_p),
        False,
        bool(return_lse),
        kv_map,
        check_softcap(softcap),
    )


def _check_alibi(alibi_slopes, B, H, q):
    if alibi_slopes is None:
        return None
    alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
    alibi_slopes = alibi_slopes[None] if alibi_slopes.dim() == 1 else alibi_slopes
    if alibi_slopes.dim() != 2 or alibi_slopes.shape[0] not in (1, B) or alibi_slopes.shape[1] != H:
        raise ValueError(f"alibi_slopes must be (H,) or (B, H) = ({B}, {H}), got {tuple(alibi_slopes.shape)}")
    return alibi_slopes


def paged_check(q, kv, v, spec: AttentionSpec) -> list[str]:
    reasons = []
    if spec.need_weights:
        reasons.append(
            "a paged read returns no weights: pass backend='math' (copies the sequences into "
            "one tensor and runs the reference), or return_lse=True and rebuild chosen rows "
            "with headwise.attention.weights_from_lse"
        )
    if spec.dropout_p > 0:
        reasons.append(
            f"a paged read has no dropout (got dropout_p={spec.dropout_p}); caches are for "
            f"inference: call model.eval(), or pass backend='math'"
        )
    return reasons
