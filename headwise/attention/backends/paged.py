"""The `paged` backend: attention over K/V that live in a block pool, read in place.

A paged cache does not hand attention one K/V tensor; it describes where each sequence's
keys are for this step (`headwise.attention.kv`: `BlockReads`, `PackedReads`), and this
backend reads them:

- a padded step (`BlockReads`): each group of rows walks its tiles (views of consecutive
  blocks, or blocks gathered a tile at a time into a reused buffer) with one fused-kernel
  call per tile, and the tiles merge by log-sum-exp (`merge_lse`);
- a packed step (`PackedReads`): the decodes of sequences that each start a region of the
  pool and fit in it are read all at once, one kernel call on one strided view
  ("regions"); other decodes whose keys are one consecutive run, one call each on a view,
  no mask ("runs"); the rest through a batched read plan ("decodes"), and each prefill
  chunk alone, bottom-right causal ("chunk").

On CPU the kernel is PyTorch's flash op, which returns the LSE and takes strided K/V
views; elsewhere (or for an fp32 bias on low-precision q) the same in fp32 matmuls.
The G query heads of a KV group are G*T rows against it (`fold_heads`), no K/V copy.
backend="math" gathers the sequences into one tensor and runs the reference instead
(`paged_reference`): weights and dropout, for tests and analysis.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kv import BlockReads, LayerKV, PackedReads, Tile, TileGroup, fold_heads, fold_mask, unfold_heads
from ..spec import AttentionOutput, AttentionSpec, _check_attn_mask, make_spec
from .merge import merge_lse
from .registry import get_backend

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
NEG_INF = float("-inf")


def in_place_ok() -> bool:
    """Whether decodes can be read as views of the pool ("runs", "regions"): needs the CPU flash op."""
    return _CPU_FLASH is not None


# ------------------------------------------------------------------ spec and check
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
    if window is not None:
        raise ValueError("a paged read has no sliding window; use SlidingWindowCache for windowed layers")
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
        None,
        alibi_slopes,
        float(dropout_p),
        bool(need_weights),
        bool(return_lse),
        kv_map,
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


# ------------------------------------------------------------------ entry points
def paged_attention(q: Tensor, kv: LayerKV, v, spec: AttentionSpec) -> AttentionOutput:
    """The registered backend: q (B, H, T, D) over `kv` (a cache's description; v unused)."""
    if isinstance(kv.reads, PackedReads):
        return _packed(q, kv, spec, reference=False)
    out, lse = _tiled(q, kv.reads, kv.layer, _Masks.of(kv.reads, spec, q.dtype), spec.kv_map, spec.scale)
    return AttentionOutput(out, lse if spec.return_lse else None, None)


def paged_reference(q: Tensor, kv: LayerKV, spec: AttentionSpec) -> AttentionOutput:
    """backend="math": gather each read plan's sequences into one tensor and run the reference."""
    if isinstance(kv.reads, PackedReads):
        return _packed(q, kv, spec, reference=True)
    return _dense(q, kv.reads, kv.layer, spec)


def _sub_spec(q: Tensor, reads: BlockReads, spec: AttentionSpec) -> AttentionSpec:
    """A packed part's spec against its own read plan (checks kv_map, dtype, ALiBi, window)."""
    return paged_spec(
        q,
        LayerKV(reads, 0),
        is_causal=spec.is_causal,
        kv_map=spec.kv_map,
        alibi_slopes=spec.alibi_slopes,
        scale=spec.scale,
        dropout_p=spec.dropout_p,
        return_lse=True,
        window=spec.window,
    )


def _block(q, reads: BlockReads, layer: int, spec: AttentionSpec, reference: bool) -> AttentionOutput:
    sub = _sub_spec(q, reads, spec)
    if reference:
        return _dense(q, reads, layer, sub)
    reasons = paged_check(q, None, None, sub)
    if reasons:
        raise ValueError(f"backend 'paged' cannot serve this request: {'; '.join(reasons)}")
    out, lse = _tiled(q, reads, layer, _Masks.of(reads, sub, q.dtype), sub.kv_map, sub.scale)
    return AttentionOutput(out, lse, None)


# ------------------------------------------------------------------ a padded step: tiles
def _tiled(q: Tensor, reads: BlockReads, layer: int, masks: "_Masks", kv_map: Tensor | None, scale: float):
    B, H, T, D = q.shape
    Hkv = reads.num_kv_heads
    qf = fold_heads(q, Hkv) if kv_map is None else q  # (B, Hkv, G*T, D) | (B, H, T, D)
    if len(reads.groups) == 1:
        return _read_group(qf, reads, layer, reads.groups[0], masks, kv_map, scale, q)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device)
    for g in reads.groups:  # one sequence each
        out[g.rows], lse[g.rows] = _read_group(qf[g.rows], reads, layer, g, masks, kv_map, scale, q[g.rows])
    return out, lse


def _read_group(
    qf: Tensor, reads: BlockReads, layer: int, group: TileGroup, masks: "_Masks", kv_map, scale: float, q: Tensor
):
    """Online softmax over the group's tiles, merged by log-sum-exp; (out, lse) as q's rows."""
    B, H, T, D = q.shape
    Hkv = reads.num_kv_heads
    G = H // Hkv if kv_map is None else 1
    acc = lse = None
    for seg in group.segments:
        k, v = reads.read_tile(layer, seg, B, q.dtype)  # (B, Hkv, n, D)
        if kv_map is not None:
            k, v = k.index_select(1, kv_map), v.index_select(1, kv_map)
        mask, dead = _tile_mask(reads, seg, group.rows, masks, kv_map is None, Hkv, G)
        o, l = _attend_tile(qf, k, v, mask, scale)
        if dead is not None:  # the CPU kernel reports LSE 0 there
            l = l.masked_fill(dead.expand_as(l), NEG_INF)
        acc, lse = merge_lse(acc, lse, o, l)
    if acc is None:  # no keys at all
        return torch.zeros_like(q), torch.full((B, H, T), NEG_INF, device=q.device)
    # Rows with no visible key are 0 already: both kernels give 0 there, and merging
    # two -inf LSEs weighs both sides by exp(-inf) = 0.
    if kv_map is None:
        return unfold_heads(acc, H).to(q.dtype), lse.reshape(B, H, T)
    return acc.to(q.dtype), lse


def _tile_mask(reads: BlockReads, seg: Tile, rows: slice, masks: "_Masks", folded: bool, Hkv: int, G: int):
    """(mask (B|1, 1|Hkv, G*T, n) or (B|1, 1|H, T, n) or None, rows with no visible key or None).
    Masks made of validity and causality alone are the same in every layer: memoised per step."""
    key = (
        (seg.k0, seg.k1, rows.start, rows.stop, folded, Hkv, G, masks.H, masks.is_causal, masks.dtype)
        if masks.plain
        else None
    )
    hit = reads.mask_memo.get(key) if key is not None else None
    if hit is not None:
        return hit
    mask = masks.tile(seg.k0, seg.k1, rows)  # float (B|1, 1|H, T, n) or None
    if mask is not None and folded:
        mask = fold_mask(mask, Hkv, G)  # (B|1, 1|Hkv, G*T, n)
    dead = None
    if mask is not None:
        dead = torch.isneginf(mask).all(dim=-1)
        dead = dead if bool(dead.any()) else None
    if key is not None:
        reads.mask_memo[key] = (mask, dead)
    return mask, dead


def _attend_tile(qf: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of qf (B, h, R, D) over one tile k, v (B, h, n, D): (out (B, h, R, D), fp32 lse (B, h, R)).
    On CPU, PyTorch's flash kernel (which returns LSE); elsewhere, or for an fp32 bias on
    low-precision q, the same in fp32 matmuls."""
    if _CPU_FLASH is not None and qf.device.type == "cpu" and (mask is None or mask.dtype == qf.dtype):
        o, lse = _CPU_FLASH(qf, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return o, lse.float()
    s = (qf.float() @ k.float().transpose(-2, -1)) * scale  # (B, h, R, n)
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    return p @ v.float(), lse


def _dense(q: Tensor, reads: BlockReads, layer: int, spec: AttentionSpec) -> AttentionOutput:
    """The reference path: gather every sequence into (B, Hkv, S, D), then the math backend."""
    nb = -(-reads.S // reads.block_size)  # blocks per padded row
    idx = torch.tensor([b for t in reads.tables for b in (t + [0] * nb)[:nb]], dtype=torch.long, device=q.device)
    k, v = reads.read_tile(layer, Tile(0, reads.S, 0, nb, idx), reads.B, q.dtype, scratch=False)
    if spec.kv_map is not None:
        k, v = k.index_select(1, spec.kv_map), v.index_select(1, spec.kv_map)
    mask = _Masks.of(reads, spec, q.dtype).tile(0, reads.S)
    k, v = k.contiguous(), v.contiguous()
    dense = make_spec(
        q,
        k,
        v,
        attn_mask=mask,
        scale=spec.scale,
        dropout_p=spec.dropout_p,
        need_weights=spec.need_weights,
        return_lse=True,
    )
    res = get_backend("math").fn(q, k, v, dense)
    return AttentionOutput(res.out, res.lse if spec.return_lse else None, res.weights)


class _Masks:
    """Builds the additive mask of any key tile [k0, k1) for some batch rows, or None when
    each of those query rows sees every key of the tile (a decode step over past keys)."""

    def __init__(self, reads: BlockReads, is_causal, attn_mask, key_padding_mask, alibi_slopes, H, dtype):
        self.reads, self.is_causal, self.H = reads, bool(is_causal), H
        self.attn_mask, self.kpm, self.alibi = attn_mask, key_padding_mask, alibi_slopes
        self.plain = attn_mask is None and key_padding_mask is None and alibi_slopes is None
        # Biases (ALiBi, float masks) stay fp32: rounded to fp16/bf16, slope * distance loses
        # ~3 digits. A mask whose dtype differs from q's sends the tile to the fp32 matmul kernel.
        has_bias = alibi_slopes is not None or (attn_mask is not None and attn_mask.dtype != torch.bool)
        self.dtype = torch.float32 if has_bias and dtype in (torch.float16, torch.bfloat16) else dtype

    @classmethod
    def of(cls, reads: BlockReads, spec: AttentionSpec, dtype) -> "_Masks":
        return cls(reads, spec.is_causal, spec.attn_mask, spec.key_padding_mask, spec.alibi_slopes, spec.H, dtype)

    def tile(self, k0: int, k1: int, rows: slice = slice(None)) -> Tensor | None:
        reads, dev = self.reads, self.reads.device
        need_valid = k1 > min(reads.ends[rows])  # keys past a sequence's end are padding
        need_causal = self.is_causal and k1 - 1 > min(reads.starts[rows])
        if not (
            need_valid or need_causal or self.attn_mask is not None or self.kpm is not None or self.alibi is not None
        ):
            return None
        kpos = torch.arange(k0, k1, device=dev)
        pos = reads.query_positions[rows]  # (b, T)
        allowed, bias = None, None
        if need_valid:
            allowed = (kpos < reads.ends_t[rows, None])[:, None, None, :]  # (b, 1, 1, n)
        if need_causal:
            c = (kpos <= pos[:, :, None])[:, None]  # (b, 1, T, n)
            allowed = c if allowed is None else allowed & c
        if self.kpm is not None:
            keep = ~self.kpm[rows, None, None, k0:k1]
            allowed = keep if allowed is None else allowed & keep
        if self.attn_mask is not None:
            m = self.attn_mask[..., k0:k1]
            m = m[rows] if m.shape[0] > 1 else m
            if m.dtype == torch.bool:
                allowed = m if allowed is None else allowed & m
            else:
                bias = m.float()
        if self.alibi is not None:  # ALiBi (Press et al. 2022): -slope * |i - j| at true positions
            slopes = self.alibi[rows] if self.alibi.shape[0] > 1 else self.alibi
            a = -slopes[:, :, None, None] * (pos[:, None, :, None] - kpos).abs().float()  # (b, H, T, n)
            bias = a if bias is None else bias + a
        parts = [p.shape for p in (allowed, bias) if p is not None]
        shape = torch.broadcast_shapes(*parts, (1, 1, reads.T, k1 - k0))  # (b|1, 1|H, T, n)
        mask = (
            torch.zeros(shape, dtype=self.dtype, device=dev)
            if bias is None
            else bias.to(self.dtype).expand(shape).contiguous()
        )
        if allowed is not None:
            mask.masked_fill_(~allowed, NEG_INF)
        return mask


# ------------------------------------------------------------------ a packed step: parts
def _packed(q: Tensor, kv: LayerKV, spec: AttentionSpec, reference: bool) -> AttentionOutput:
    """q (1, H, N, D) -> (1, H, N, D) (lse (1, H, N) with return_lse): each token over its own
    sequence's keys, part by part."""
    reads, layer, return_lse = kv.reads, kv.layer, spec.return_lse
    N, H = reads.N, q.shape[1]
    parts = reads.parts
    if len(parts) == 1 and parts[0].kind == "chunk":  # one prefill chunk: no copies
        res = _block(q, parts[0].reads, layer, spec, reference)
        return AttentionOutput(res.out, res.lse if return_lse else None, None)
    in_place = (
        spec.kv_map is None
        and spec.alibi_slopes is None
        and spec.dropout_p == 0
        and not reference
        and spec.window is None
        and H % reads.num_kv_heads == 0
        and q.dtype == reads.dtype
        and q.device.type == "cpu"
    )
    out = torch.empty_like(q)
    lse = torch.empty(1, H, N, device=q.device) if return_lse else None
    for i, part in enumerate(parts):
        if part.kind == "chunk":
            res = _block(q[:, :, part.start : part.stop], part.reads, layer, spec, reference)
            out[:, :, part.start : part.stop] = res.out
            if lse is not None:
                lse[:, :, part.start : part.stop] = res.lse
            continue
        rows = q[0, :, part.start : part.stop] if part.index is None else q[0].index_select(1, part.index)
        rows = rows.transpose(0, 1)  # (Bd, H, D)
        if part.kind in ("runs", "regions") and in_place:
            attend_part = _attend_runs if part.kind == "runs" else _attend_regions
            o, l = attend_part(reads, layer, rows, i, spec.scale, return_lse)
            if len(parts) == 1 and not return_lse:  # a pure decode step: no copy back
                return AttentionOutput(o.transpose(0, 1)[None], None, None)  # (1, H, N, D), memory (N, H, D)
        else:
            sub = part.reads if part.kind == "decodes" else reads.fallback(i)
            res = _block(rows[:, :, None], sub, layer, spec, reference)  # (Bd, H, 1, D)
            o, l = res.out[:, :, 0], res.lse[:, :, 0]
        o = o.transpose(0, 1)  # (H, Bd, D)
        if part.index is None:
            out[0, :, part.start : part.stop] = o
            if lse is not None:
                lse[0, :, part.start : part.stop] = l.transpose(0, 1)
        else:
            out[0].index_copy_(1, part.index, o)
            if lse is not None:
                lse[0].index_copy_(1, part.index, l.transpose(0, 1).to(lse.dtype))
    return AttentionOutput(out, lse, None)


def _grid_mask(reads: PackedReads, i: int, G: int, dtype) -> Tensor:
    """(count, 1, G, width) additive mask of regions part i: each sequence sees its own keys;
    region slots without a sequence see everything (finite garbage, dropped), not nothing."""
    key = ("grid", i, G, dtype)
    mask = reads.mask_memo.get(key)
    if mask is None:
        grid = reads.parts[i].grid
        mask = torch.zeros(grid.count, 1, G, grid.width, dtype=dtype, device=reads.device)
        for j, S in zip(grid.slot, grid.lengths):
            mask[j, :, :, S:] = float("-inf")
        reads.mask_memo[key] = mask
    return mask


def _attend_regions(reads: PackedReads, layer: int, rows: Tensor, i: int, scale: float | None, want_lse: bool):
    """Decode rows (Bd, H, D) of sequences that each start a region of R blocks and fit in it:
    region r's keys are slots [r * R * bs, r * R * bs + width) of the pool, a fixed stride
    apart, so one as_strided view (count, Hkv, width, D) of the pool holds them all, and
    one kernel call with a length mask reads them: no gather, one call per layer instead
    of one per sequence. -> (out (Bd, H, D), lse (Bd, H) or None)."""
    grid = reads.parts[i].grid
    Bd, H, D = rows.shape
    Hkv = reads.num_kv_heads
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = fold_heads(rows[:, :, None], Hkv)  # (Bd, Hkv, G, D)
    if grid.gather is not None:
        q = q.new_zeros(grid.count, Hkv, G, D).index_copy_(0, grid.gather, q)
    k, v = reads.region_views(layer, i)  # (count, Hkv, width, D)
    o, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=_grid_mask(reads, i, G, q.dtype), scale=scale)[:2]
    if grid.gather is not None:
        o, lse = o.index_select(0, grid.gather), lse.index_select(0, grid.gather)
    return o.reshape(Bd, H, D), (lse.reshape(Bd, H).float() if want_lse else None)


def _attend_runs(reads: PackedReads, layer: int, rows: Tensor, i: int, scale: float | None, want_lse: bool):
    """Decode rows (Bd, H, D), each over its sequence's keys, which lie in consecutive slots
    [s0, s0 + n) of the pool: one fused-kernel call per sequence on a view of the pool,
    nothing gathered, no mask (a decode token sees every key of its sequence), no
    log-sum-exp merging; the G query heads of a KV group are G rows (GQA, no K/V copy).
    Copying a 256-token sequence's K/V out and reading it back costs more than the
    ~20 us of dispatch per call. -> (out (Bd, H, D), lse (Bd, H) or None)."""
    Bd, H, D = rows.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    views = reads.run_views(i)  # Bd x (K, V) (L, 1, Hkv, n, D)
    qs = fold_heads(rows[:, :, None], reads.num_kv_heads).split(1)  # Bd x (1, Hkv, G, D)
    res = [_CPU_FLASH(qb, k[layer], v[layer], 0.0, False, scale=scale) for qb, (k, v) in zip(qs, views)]
    o = torch.cat([r[0] for r in res]).view(Bd, H, D)
    lse = torch.cat([r[1] for r in res]).view(Bd, H).float() if want_lse else None
    return o, lse
