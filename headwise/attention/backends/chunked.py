"""FlashAttention in pure PyTorch: online softmax over key tiles.

Forward (Milakov & Gimelshein 2018; Dao et al. 2022): for each block of queries,
walk the key tiles, each giving its own softmax output and log-sum-exp, merged into
the running result by `merge_lse` (the one merge, shared with the `paged` backend),
so the (T, S) score matrix never exists; extra memory is O(T*D + block_q*block_k)
and the log-sum-exp per row comes out for free.
Backward recomputes each tile's probabilities from the saved LSE (FlashAttention-2,
Dao 2023), so training needs no O(T*S) memory either.

Masks are built per tile (`tile_masks`) and tiles that causal/window structure
masks completely are skipped, which halves the work of causal attention.
"""

from __future__ import annotations

import torch

from ..kv import fold_heads, unfold_heads
from ..masks import tile_is_empty, tile_masks
from ..spec import AttentionOutput, AttentionSpec
from .merge import merge_lse

# Tile sizes measured here (B=4, H=12, D=64, T=512 and 2048): 128x256 and 256x256 ran
# 1.2-1.9x faster than 256x512, whose 25 MiB score tiles spill out of cache.
BLOCK_Q = 128  # query rows per block
BLOCK_K = 256  # keys per tile: a scores tile is B*H*128*256*4 bytes = 1.5 MiB at B=1, H=12

NEG_INF = float("-inf")


def _scores(spec, qb, kb, q0, q1, k0, k1):
    """Masked scores of one tile in fp32, and with soft-capping the tanh (B, H, tq, tk) it took
    (the backward's d cap / d s = 1 - tanh^2), else None. qb: (B, Hkv, G*tq, D), already scaled;
    kb: (B, Hkv, tk, D). Runs without autograd (forward and the recomputing backward), so it
    works in place."""
    s = unfold_heads(qb @ kb.transpose(-2, -1), spec.H)  # (B, H, tq, tk)
    t = None
    if spec.softcap is not None:  # Gemma 2: c * tanh(s / c), before masks and biases
        t = s.div_(spec.softcap).tanh_()
        s = t * spec.softcap
    allowed, bias = tile_masks(spec, q0, q1, k0, k1, qb.device)
    if bias is not None:
        s += bias
    if allowed is not None:
        s.masked_fill_(~allowed, NEG_INF)
    return s, t


def _group(t, spec, q0, q1, scale=1.0):
    """(B, H, T, X) rows [q0, q1) -> fp32 (B, Hkv, G*tq, X): a GQA group shares one K/V head."""
    rows = t[:, :, q0:q1].float()
    rows = rows * scale if scale != 1.0 else rows
    return fold_heads(rows, spec.Hkv)


def _forward(q, k, v, spec, block_q, block_k):
    B, H, T, S, Dv = spec.B, spec.H, spec.T, spec.S, v.shape[-1]
    out = torch.empty(B, H, T, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        qb = _group(q, spec, q0, q1, spec.scale)  # scale once per block, not per tile
        acc = run = None  # merged (out, lse) of the tiles so far
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if tile_is_empty(spec, q0, q1, k0, k1):
                continue
            s, _ = _scores(spec, qb, k[:, :, k0:k1].float(), q0, q1, k0, k1)  # (B, H, tq, tk)
            m = s.amax(dim=-1)
            p = s.sub_(m.masked_fill(torch.isneginf(m), 0.0)[..., None]).exp_()  # in place; 0 where masked
            l = p.sum(dim=-1)  # (B, H, tq)
            pv = unfold_heads(fold_heads(p, spec.Hkv) @ v[:, :, k0:k1].float(), H)  # (B, H, tq, Dv)
            o = pv / l.clamp_min(1e-30)[..., None]  # this tile's softmax; 0 on dead rows
            acc, run = merge_lse(acc, run, o, m + torch.log(l))  # lse -inf where nothing was visible
        if acc is None:  # every tile masked out
            out[:, :, q0:q1], lse[:, :, q0:q1] = 0.0, NEG_INF
        else:
            out[:, :, q0:q1], lse[:, :, q0:q1] = acc, run
    return out, lse


def _backward(q, k, v, out, lse, dout, dlse, spec, block_q, block_k):
    B, H, T, S, Hkv, G, D, Dv = spec.B, spec.H, spec.T, spec.S, spec.Hkv, spec.G, spec.D, v.shape[-1]
    dq = torch.zeros(B, H, T, D, device=q.device)
    dk = torch.zeros(B, Hkv, S, D, device=q.device)
    dv = torch.zeros(B, Hkv, S, Dv, device=q.device)
    delta = (dout.float() * out.float()).sum(dim=-1)  # (B, H, T): rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.float()  # d lse / d s = p
    lse_safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        tq = q1 - q0
        qs = _group(q, spec, q0, q1, spec.scale)  # (B, Hkv, G*tq, D), scaled
        dob = _group(dout, spec, q0, q1)  # (B, Hkv, G*tq, Dv)
        dqb = torch.zeros(B, Hkv, G * tq, D, device=q.device)
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if tile_is_empty(spec, q0, q1, k0, k1):
                continue
            kb, vb = k[:, :, k0:k1].float(), v[:, :, k0:k1].float()
            s, t = _scores(spec, qs, kb, q0, q1, k0, k1)
            p = s.sub_(lse_safe[:, :, q0:q1, None]).exp_()  # (B, H, tq, tk), recomputed
            pg = fold_heads(p, Hkv)  # (B, Hkv, G*tq, tk)
            dv[:, :, k0:k1] += pg.transpose(-2, -1) @ dob  # sums over the group
            dp = unfold_heads(dob @ vb.transpose(-2, -1), H)  # (B, H, tq, tk)
            ds = p * (dp - delta[:, :, q0:q1, None])  # d loss / d (capped) scores
            if t is not None:  # through the cap: d (c tanh(s / c)) / d s = 1 - tanh^2
                ds = ds * (1 - t * t)
            ds = fold_heads(ds, Hkv)
            dqb += ds @ kb
            dk[:, :, k0:k1] += ds.transpose(-2, -1) @ qs  # scaled q: the scale is already in
        dq[:, :, q0:q1] = unfold_heads(dqb, H)
    return (dq * spec.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, block_q, block_k):
        out, lse = _forward(q, k, v, spec, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.blocks = spec, (block_q, block_k)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.spec, *ctx.blocks)
        return dq, dk, dv, None, None, None


def chunked_attention(
    q, k, v, spec: AttentionSpec, *, block_q: int | None = None, block_k: int | None = None
) -> AttentionOutput:
    """Tiled attention; `block_q`/`block_k` default to the module's BLOCK_Q/BLOCK_K."""
    block_q, block_k = block_q or BLOCK_Q, block_k or BLOCK_K
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _ChunkedAttention.apply(q, k, v, spec, block_q, block_k)
    else:
        out, lse = _forward(q, k, v, spec, block_q, block_k)
    return AttentionOutput(out, lse if spec.return_lse else None, None)


def chunked_check(q, k, v, spec: AttentionSpec) -> list[str]:
    reasons = []
    if spec.need_weights:
        reasons.append("returns no weights (use backend='math', or return_lse with weights_from_lse)")
    if spec.dropout_p > 0:
        reasons.append("no dropout")
    for name, t in (("attn_mask", spec.attn_mask), ("alibi_slopes", spec.alibi_slopes)):
        if t is not None and t.requires_grad:
            reasons.append(f"computes no gradient for {name}")
    return reasons
