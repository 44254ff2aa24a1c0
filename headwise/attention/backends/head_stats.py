"""Per-head attention statistics from key tiles, without the (T, S) weights.

Seeing what a head does at 16k tokens cannot go through its pattern: SmolLM2's would be
30 layers x 9 heads x 16k^2 x 4 B ~ 290 GB. Every statistic below is a sum over keys of
the weight a_ij times something of the key, so it can be accumulated tile by tile, as the
`chunked` backend accumulates its output. Given each row's final log-sum-exp (from the
fused forward, or from a first pass here), a tile's weights are exact at once,
a_ij = exp(s_ij - LSE_i) (FlashAttention-2's backward recomputes them the same way, Dao
2023), and nothing is rescaled. Extra memory is O(B*H*T) for the per-row results plus one
(B, H, block_q, block_k) tile.

Per query row, `HeadStats` holds, (B, H, T) fp32 each (p = the row's absolute position):

    visible        number of keys the row may see (0: a fully masked row; every stat is 0)
    entropy        -sum_j a_ij log a_ij, in nats
    max_weight     max_j a_ij
    sink_mass      mass on the first `sinks` positions (StreamingLLM keeps 4 such tokens,
                   Xiao et al. 2023, "Efficient streaming language models with attention sinks")
    local_mass     mass on keys with |p - j| <= `local`
    distance       sum_j a_ij |p - j|: the mean attended distance in tokens
    sink_distance  the part of `distance` that falls on sink keys
    visible_sinks  how many sink keys the row may see
    spread         sum of |p - j| over visible non-sink keys (so spread / (visible -
                   visible_sinks) is the mean distance uniform attention would have)
    offsets        (B, H, T, 2K+1): mass on the key at j = p + o, o = -K..K (K = `offsets`)
    offsets_visible  (B, H, T, 2K+1): 1 where that key exists and the row may see it

and with `key_norms` n_hj = ||f_h(x_j)|| (Kobayashi et al. 2020, "Attention is not only a
weight"; `headwise.analysis.attribution.value_norms`), the budget sum_j a_ij n_hj splits as:

    top_norm_share   a_ij n_hj / sum_j a_ij n_hj at the row's most attended key j (the
                     first of equal maxima, as argmax), attribution.HintGaps' definition
    sink_norm_share  the share of that budget on the sink keys

Masks are `tile_masks`' (causal, sliding window, padding, attn_mask, ALiBi), so they mean
what they mean in every backend; tiles the causal/window structure hides are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..kv import unfold_heads
from ..masks import tile_is_empty, tile_masks
from ..spec import AttentionSpec, make_spec
from .chunked import _group

# Tiles of 256 x 256 (B=1, H=9, Hkv=3, D=64, T=4096, 2 threads): 2.2 s against 4.2 s for chunked's
# 128 x 256 and 4.5 s for 256 x 512 on a busy host; the per-tile calls (~40) dominate small tiles.
BLOCK_Q = 256
BLOCK_K = 256

SINKS = 4  # StreamingLLM's number of sink tokens
LOCAL = 16  # "local" = within 16 tokens: a few words either side at long context
MAX_OFFSET = 8  # offsets -8..8, as analysis.roles scores them
LOGP_FLOOR = -200.0  # log-weights below this are exp() == 0 in fp32 anyway; clamping avoids 0 * -inf


@dataclass
class HeadStats:
    """Per-row statistics of one attention call; see the module docstring for each field."""

    visible: Tensor
    entropy: Tensor
    max_weight: Tensor
    sink_mass: Tensor
    local_mass: Tensor
    distance: Tensor
    sink_distance: Tensor
    visible_sinks: Tensor
    spread: Tensor
    offsets: Tensor  # (B, H, T, 2K+1)
    offsets_visible: Tensor  # (B, H, T, 2K+1)
    top_norm_share: Tensor | None = None
    sink_norm_share: Tensor | None = None

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


def attention_stats(
    q: Tensor,
    k: Tensor,
    *,
    lse: Tensor | None = None,
    key_norms: Tensor | None = None,
    sinks: int = SINKS,
    local: int = LOCAL,
    offsets: int = MAX_OFFSET,
    block_q: int | None = None,
    block_k: int | None = None,
    **mask_kwargs,
) -> HeadStats:
    """`head_stats` with `attend`'s mask arguments (attn_mask, key_padding_mask, is_causal,
    window, alibi_slopes, scale, softcap): q (B, H, T, D), k (B, Hkv, S, D). Pass the LSE of the
    `attend(..., return_lse=True)` call with the same masks to skip the first pass."""
    spec = make_spec(q, k, k, **mask_kwargs)
    return head_stats(
        q,
        k,
        spec,
        lse=lse,
        key_norms=key_norms,
        sinks=sinks,
        local=local,
        offsets=offsets,
        block_q=block_q,
        block_k=block_k,
    )


@torch.no_grad()
def head_stats(
    q: Tensor,
    k: Tensor,
    spec: AttentionSpec,
    *,
    lse: Tensor | None = None,
    key_norms: Tensor | None = None,
    sinks: int = SINKS,
    local: int = LOCAL,
    offsets: int = MAX_OFFSET,
    block_q: int | None = None,
    block_k: int | None = None,
) -> HeadStats:
    """Statistics of every query row of `attend(q, k, v, spec)` in O(T) memory (v is not needed:
    no statistic here looks at values, except through `key_norms` (B, H, S))."""
    B, H, T, S = spec.B, spec.H, spec.T, spec.S
    block_q, block_k = block_q or BLOCK_Q, block_k or BLOCK_K
    for name, value in (("sinks", sinks), ("local", local), ("offsets", offsets)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if spec.dropout_p:
        raise ValueError("head_stats describes the weights before dropout; pass dropout_p=0")
    if key_norms is not None and tuple(key_norms.shape) != (B, H, S):
        raise ValueError(
            f"key_norms has shape {tuple(key_norms.shape)} but must be (B, H, S) = ({B}, {H}, {S}): one norm "
            f"per query head and key (attribution.value_norms)"
        )
    if lse is None:
        lse = row_lse(q, k, spec, block_q, block_k)
    elif tuple(lse.shape) != (B, H, T):
        raise ValueError(f"lse has shape {tuple(lse.shape)} but q implies (B, H, T) = ({B}, {H}, {T})")
    acc = _Rows(B, H, T, 2 * offsets + 1, key_norms is not None, q.device)
    # Scores and weights of every tile go into two buffers: a fresh 2.4 MiB tile costs a page fault
    # per 4 KiB each time (SmolLM2 at T=4096: 0.44 s instead of 0.73 s a layer, 1 thread)
    bufs_all = tuple(torch.empty(B * H * block_q * block_k, device=q.device) for _ in range(2))
    ref_all = lse.float().masked_fill(torch.isneginf(lse), 0.0)  # dead rows: p = exp(-inf) = 0 anyway
    norms = key_norms.float() if key_norms is not None else None
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        qb = _group(q, spec, q0, q1, spec.scale)  # (B, Hkv, G*tq, D)
        ref = ref_all[:, :, q0:q1, None]  # (B, H, tq, 1)
        best = torch.full((B, H, q1 - q0), -1.0, device=q.device)  # running max weight
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if tile_is_empty(spec, q0, q1, k0, k1):
                continue
            _Tile(spec, q0, q1, k0, k1, sinks, local, offsets).add(qb, k, ref, norms, acc, best, bufs_all)
        acc.max_weight[:, :, q0:q1] = best.clamp_min(0.0)
    return acc.result(norms is not None)


def row_lse(q: Tensor, k: Tensor, spec: AttentionSpec, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Tensor:
    """The first pass: each row's log-sum-exp (B, H, T) fp32, -inf on fully masked rows."""
    out = torch.full((spec.B, spec.H, spec.T), float("-inf"), device=q.device)
    for q0 in range(0, spec.T, block_q):
        q1 = min(q0 + block_q, spec.T)
        qb = _group(q, spec, q0, q1, spec.scale)
        for k0 in range(0, spec.S, block_k):
            k1 = min(k0 + block_k, spec.S)
            if tile_is_empty(spec, q0, q1, k0, k1):
                continue
            s, _, _ = _scores(spec, qb, k, q0, q1, k0, k1)
            out[:, :, q0:q1] = torch.logaddexp(out[:, :, q0:q1], torch.logsumexp(s, dim=-1))
    return out


def _scores(spec, qb, k, q0, q1, k0, k1, out: Tensor | None = None) -> tuple[Tensor, Tensor | None, bool]:
    """Masked fp32 scores (B, H, tq, tk) of a tile, its `allowed` mask (None = all visible; a float
    attn_mask's -inf entries count as hidden) and whether any score may be -inf. out: a flat fp32
    buffer to write them into."""
    kt = k[:, :, k0:k1].float().transpose(-2, -1)  # (B, Hkv, D, tk)
    if out is None:
        s = qb @ kt
    else:
        shape = (*qb.shape[:3], kt.shape[-1])  # (B, Hkv, G*tq, tk)
        s = torch.matmul(qb, kt, out=out[: math.prod(shape)].view(shape))
    s = unfold_heads(s, spec.H)
    if spec.softcap is not None:  # Gemma 2: c * tanh(s / c) before masks, as every backend
        s = s.div_(spec.softcap).tanh_().mul_(spec.softcap)
    allowed, bias = tile_masks(spec, q0, q1, k0, k1, qb.device)
    if bias is not None:
        s += bias
        if spec.attn_mask is not None and spec.attn_mask.dtype != torch.bool:
            finite = torch.isfinite(bias)
            allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s, allowed, allowed is not None


class _Rows:
    """The (B, H, T) running sums, filled tile by tile."""

    def __init__(self, B, H, T, n_offsets, with_norms, device):
        zeros = lambda *extra: torch.zeros(B, H, T, *extra, device=device)  # noqa: E731
        for name in ("visible", "entropy", "max_weight", "sink_mass", "local_mass", "distance"):
            setattr(self, name, zeros())
        for name in ("sink_distance", "visible_sinks", "spread"):
            setattr(self, name, zeros())
        self.offsets = zeros(n_offsets)
        self.offsets_visible = zeros(n_offsets)
        self.budget = zeros() if with_norms else None  # sum_j a_ij n_j
        self.top_norm = zeros() if with_norms else None  # a n at the most attended key
        self.sink_norm = zeros() if with_norms else None

    def result(self, with_norms: bool) -> HeadStats:
        out = HeadStats(
            self.visible,
            self.entropy,
            self.max_weight,
            self.sink_mass,
            self.local_mass,
            self.distance,
            self.sink_distance,
            self.visible_sinks,
            self.spread,
            self.offsets,
            self.offsets_visible,
        )
        if with_norms:
            budget = self.budget.clamp_min(1e-30)
            out.top_norm_share, out.sink_norm_share = self.top_norm / budget, self.sink_norm / budget
        return out


class _Tile:
    """One (query block, key tile): where it sits against the diagonal, and its contributions."""

    def __init__(self, spec, q0, q1, k0, k1, sinks, local, offsets):
        self.spec, self.q0, self.q1, self.k0, self.k1 = spec, q0, q1, k0, k1
        self.sinks, self.local, self.K = sinks, local, offsets
        self.first_q, self.last_q = q0 + spec.q_offset, q1 - 1 + spec.q_offset  # absolute positions
        self.left = k1 - 1 <= self.first_q  # every key at or before every query
        self.right = k0 >= self.last_q  # every key at or after every query

    def near(self, reach: int) -> bool:
        """Some (query, key) pair of the tile is within `reach` positions."""
        return self.k1 - 1 >= self.first_q - reach and self.k0 <= self.last_q + reach

    def add(self, qb, k, ref, norms, acc: _Rows, best: Tensor, bufs: tuple[Tensor, Tensor]) -> None:
        spec, q0, q1, k0, k1 = self.spec, self.q0, self.q1, self.k0, self.k1
        dev = qb.device
        s, allowed, masked = _scores(spec, qb, k, q0, q1, k0, k1, bufs[0])  # (B, H, tq, tk)
        s.sub_(ref)  # log a_ij, -inf where masked
        p = torch.exp(s, out=bufs[1][: s.numel()].view(s.shape))  # a_ij, exact: the final LSE is known
        rows = slice(q0, q1)
        pos = torch.arange(self.first_q, self.last_q + 1, device=dev, dtype=torch.float32)[:, None]  # (tq, 1)
        kpos = torch.arange(k0, k1, device=dev, dtype=torch.float32)  # (tk,)
        absrel = None if (self.left or self.right) else (pos - kpos).abs()  # (tq, tk), diagonal tiles only

        n = norms[:, :, k0:k1] if norms is not None else None  # (B, H, tk)
        mx = p.amax(dim=-1)  # (B, H, tq)
        better = mx > best  # strict: an earlier tile keeps a tie, as argmax keeps the first maximum
        if n is not None and bool(better.any()):
            # argmax only on rows whose maximum moved (max-with-index costs ~10x amax here; once a
            # row has found its sink, later tiles rarely beat it)
            sel = better.nonzero(as_tuple=True)  # (b, h, r) of those rows
            arg = p[sel].argmax(dim=-1)  # (R,)
            acc.top_norm[:, :, rows][sel] = mx[sel] * n[sel[0], sel[1], arg]
        torch.maximum(best, mx, out=best)

        # Row sums as matrix-vector products (a (tk, 2) matmul takes ~15x longer than two of them).
        flat = p.view(-1, k1 - k0)  # (B*H*tq, tk)
        mass = (flat @ torch.ones_like(kpos)).view_as(mx)
        if self.left:  # |p - j| = (p - (k1 - 1)) + ((k1 - 1) - j): both >= 0, no cancellation
            acc.distance[:, :, rows] += (pos[:, 0] - (k1 - 1)) * mass + (flat @ ((k1 - 1) - kpos)).view_as(mx)
        elif self.right:  # |p - j| = (k0 - p) + (j - k0)
            acc.distance[:, :, rows] += (k0 - pos[:, 0]) * mass + (flat @ (kpos - k0)).view_as(mx)
        else:
            acc.distance[:, :, rows] += (p * absrel).sum(-1)
        if n is not None:  # one matrix-vector product per (b, h): 2x faster than (p * n).sum(-1)
            budget = acc.budget[:, :, rows]
            for b in range(p.shape[0]):
                for h in range(p.shape[1]):
                    budget[b, h] += p[b, h] @ n[b, h]

        if masked:
            s.clamp_min_(LOGP_FLOOR)  # masked entries: p = 0 and log p = -200, so p log p = 0
        acc.entropy[:, :, rows] -= s.mul_(p).sum(-1)

        self._visibility(acc, allowed, pos[:, 0], kpos, absrel)
        if k0 < self.sinks:
            ks = min(self.sinks, k1) - k0  # the tile's first ks keys are sinks
            ps = p[..., :ks]
            dist = (pos - kpos[:ks]).abs()  # (tq, ks)
            acc.sink_mass[:, :, rows] += ps.sum(-1)
            acc.sink_distance[:, :, rows] += (ps * dist).sum(-1)
            if norms is not None:
                acc.sink_norm[:, :, rows] += (ps * n[..., None, :ks]).sum(-1)
        if self.near(self.local):
            band = ((pos - kpos).abs() <= self.local).float()  # (tq, tk)
            acc.local_mass[:, :, rows] += (p * band).sum(-1)
        if self.near(self.K):
            self._offsets(acc, p, allowed)

    def _visibility(self, acc: _Rows, allowed, pos, kpos, absrel) -> None:
        """Visible keys, visible sinks and the uniform spread |p - j| over visible non-sink keys."""
        rows, k0, k1 = slice(self.q0, self.q1), self.k0, self.k1
        tk = k1 - k0
        ks = max(0, min(self.sinks, k1) - k0)
        if allowed is None and absrel is None:  # all visible, one side of the diagonal: closed form
            total = tk * pos - (k0 + k1 - 1) * tk / 2  # sum_j (p - j)
            spread = total if self.left else -total
            acc.visible[:, :, rows] += tk
            if ks:
                acc.visible_sinks[:, :, rows] += ks
                spread = spread - (pos[:, None] - kpos[:ks]).abs().sum(-1)
            acc.spread[:, :, rows] += spread
            return
        vis = torch.ones(self.q1 - self.q0, tk, device=pos.device) if allowed is None else allowed.float()
        dist = absrel if absrel is not None else (pos[:, None] - kpos).abs()
        acc.visible[:, :, rows] += vis.sum(-1)
        nonsink = vis[..., ks:]
        acc.spread[:, :, rows] += (nonsink * dist[:, ks:]).sum(-1)
        if ks:
            acc.visible_sinks[:, :, rows] += vis[..., :ks].sum(-1)

    def _offsets(self, acc: _Rows, p: Tensor, allowed: Tensor | None) -> None:
        """Mass at j = p + o: the tile's diagonals. Row r is at position first_q + r, column c at
        k0 + c, so offset o is the diagonal c - r = first_q - k0 + o."""
        if allowed is not None:  # (tq, tk) or (B|1, H|1, 1|tq, tk): padding masks need their rows for diagonals
            allowed = allowed.expand(*allowed.shape[:-2], *p.shape[-2:])
        for o in range(-self.K, self.K + 1):
            d = self.first_q - self.k0 + o
            diag = torch.diagonal(p, offset=d, dim1=-2, dim2=-1)  # (B, H, n)
            n = diag.shape[-1]
            if n == 0:
                continue
            r0 = max(0, -d)
            at = (slice(None), slice(None), slice(self.q0 + r0, self.q0 + r0 + n), o + self.K)
            acc.offsets[at] += diag
            acc.offsets_visible[at] += 1.0 if allowed is None else torch.diagonal(allowed, offset=d, dim1=-2, dim2=-1)
