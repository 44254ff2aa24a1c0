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
  no mask ("runs"); the rest ("decodes") in place through their block tables, one kernel call
  (headwise.kernels.attention.paged_decode_attention; fp32, built here), else through a
  batched read plan; and each prefill chunk alone, bottom-right causal ("chunk").

On CPU the kernel is PyTorch's flash op, which returns the LSE and takes strided K/V
views; elsewhere (or for an fp32 bias on low-precision q) the same in fp32 matmuls. fp32
"regions" go through headwise.kernels.attention instead (one pass over K/V with the lengths,
no mask) when it is built here.
The G query heads of a KV group are G*T rows against it (`fold_heads`), no K/V copy.
backend="math" gathers the sequences into one tensor and runs the reference instead
(`paged_reference`): weights and dropout, for tests and analysis.

This module holds the entry points and the reads; the checks of a request (`paged_spec`,
`paged_check`) are in paged_spec.py, the additive masks of tiles and regions in paged_masks.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...kernels import attention as kernel_attention
from ...kernels import prefill as kernel_prefill
from ..kv import BlockReads, LayerKV, PackedReads, Tile, TileGroup, fold_heads, unfold_heads
from ..spec import AttentionOutput, AttentionSpec, make_spec, soft_cap
from .merge import merge_lse
from .paged_masks import NEG_INF, TileMasks, grid_mask, tile_mask
from .paged_spec import paged_check, paged_spec
from .registry import get_backend

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def in_place_ok() -> bool:
    """Whether decodes can be read as views of the pool ("runs", "regions"): needs the CPU flash op."""
    return _CPU_FLASH is not None


# ------------------------------------------------------------------ entry points
def paged_attention(q: Tensor, kv: LayerKV, v, spec: AttentionSpec) -> AttentionOutput:
    """The registered backend: q (B, H, T, D) over `kv` (a cache's description; v unused)."""
    if isinstance(kv.reads, PackedReads):
        return _packed(q, kv, spec, reference=False)
    masks = TileMasks.of(kv.reads, spec, q.dtype)
    out, lse = _tiled(q, kv.reads, kv.layer, masks, spec.kv_map, spec.scale, spec.softcap)
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
        softcap=spec.softcap,
    )


def _block(q, reads: BlockReads, layer: int, spec: AttentionSpec, reference: bool) -> AttentionOutput:
    sub = _sub_spec(q, reads, spec)
    if reference:
        return _dense(q, reads, layer, sub)
    reasons = paged_check(q, None, None, sub)
    if reasons:
        raise ValueError(f"backend 'paged' cannot serve this request: {'; '.join(reasons)}")
    out, lse = _tiled(q, reads, layer, TileMasks.of(reads, sub, q.dtype), sub.kv_map, sub.scale, sub.softcap)
    return AttentionOutput(out, lse, None)


# ------------------------------------------------------------------ a padded step: tiles
def _tiled(q: Tensor, reads: BlockReads, layer: int, masks: TileMasks, kv_map: Tensor | None, scale: float, softcap):
    B, H, T, D = q.shape
    Hkv = reads.num_kv_heads
    qf = fold_heads(q, Hkv) if kv_map is None else q  # (B, Hkv, G*T, D) | (B, H, T, D)
    if len(reads.groups) == 1:
        return _read_group(qf, reads, layer, reads.groups[0], masks, kv_map, (scale, softcap), q)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device)
    for g in reads.groups:  # one sequence each
        out[g.rows], lse[g.rows] = _read_group(qf[g.rows], reads, layer, g, masks, kv_map, (scale, softcap), q[g.rows])
    return out, lse


def _read_group(
    qf: Tensor, reads: BlockReads, layer: int, group: TileGroup, masks: TileMasks, kv_map, scaling, q: Tensor
):
    """Online softmax over the group's tiles, merged by log-sum-exp; (out, lse) as q's rows.
    scaling: (scale, softcap). Tiles wholly outside every row's window are not read."""
    B, H, T, D = q.shape
    scale, softcap = scaling
    Hkv = reads.num_kv_heads
    G = H // Hkv if kv_map is None else 1
    acc = lse = None
    for seg in group.segments:
        if masks.outside_window(seg.k0, seg.k1, group.rows):
            continue  # its blocks may be freed already (the cache frees what falls out of a window)
        k, v = reads.read_tile(layer, seg, B, q.dtype)  # (B, Hkv, n, D)
        cut = masks.first_key(group.rows) - seg.k0  # keys before every row's window: out of the math
        if cut > 0:
            k, v, seg = k[:, :, cut:], v[:, :, cut:], seg._replace(k0=seg.k0 + cut)
        if kv_map is not None:
            k, v = k.index_select(1, kv_map), v.index_select(1, kv_map)
        causal = _prefill_kernel_mask(reads, group, seg, masks, kv_map, q, k)
        if causal is not None:  # the prefill kernel draws this tile's mask itself
            left = masks.window[0] if causal and masks.window is not None else None  # the kernel's window
            o, l = kernel_prefill.prefill_attention_unchecked(q, k, v, scale, causal, True, left, softcap)
            acc, lse = merge_lse(acc, lse, fold_heads(o, Hkv), l.reshape(B, Hkv, G * T))
            continue
        mask, dead = tile_mask(reads, seg, group.rows, masks, kv_map is None, Hkv, G)
        o, l = _attend_tile(qf, k, v, mask, scale, softcap)
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


def _prefill_kernel_mask(
    reads: BlockReads, group: TileGroup, seg: Tile, masks: TileMasks, kv_map, q: Tensor, k: Tensor
) -> bool | None:
    """Whether kernels.prefill reads this tile of one sequence's prefill chunk, and with which
    mask: causal=True where the tile ends at the sequence's last key and holds every key of the
    chunk's queries (then query t sees the tile's keys up to t + n - T, the kernel's bottom-right
    causal, within a causal window as well), False where every query sees the whole tile; None:
    the tile mask and flash instead."""
    rows = range(reads.B)[group.rows]
    if len(rows) != 1 or not masks.plain or kv_map is not None or q.dtype != torch.float32:
        return None
    if masks.window is not None and not masks.is_causal:  # a two-sided window: the tile mask
        return None
    if torch.is_grad_enabled() and q.requires_grad:  # a forward-only kernel
        return None
    b = rows[0]
    start, end, T = reads.starts[b], reads.ends[b], q.shape[2]
    if end - start != T or seg.k1 > end or q.device.type != "cpu" or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    if not _prefill_takes(q.shape[1], reads):
        return None
    if not masks.is_causal or seg.k1 - 1 <= start:  # no query meets a future key of the tile
        # ... and, with a window, the last query's window holds the whole tile
        return False if masks.window is None or seg.k0 >= end - 1 - masks.window[0] else None
    return True if seg.k1 == end and seg.k0 <= start else None


def _prefill_takes(H: int, reads: BlockReads) -> bool:
    Hkv = reads.num_kv_heads
    return (
        H % Hkv == 0
        and kernel_prefill.fits(H // Hkv, reads.head_dim)
        and kernel_prefill.prefill_attention_unavailable() is None
    )


def _attend_tile(
    qf: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of qf (B, h, R, D) over one tile k, v (B, h, n, D): (out (B, h, R, D), fp32 lse (B, h, R)).
    On CPU, PyTorch's flash kernel (which returns LSE); elsewhere, for an fp32 bias on
    low-precision q, or with a soft-cap (c * tanh(s / c) before the mask), the same in fp32 matmuls."""
    flash = _CPU_FLASH is not None and qf.device.type == "cpu" and softcap is None
    if flash and (mask is None or mask.dtype == qf.dtype):
        o, lse = _CPU_FLASH(qf, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return o, lse.float()
    s = soft_cap((qf.float() @ k.float().transpose(-2, -1)) * scale, softcap)  # (B, h, R, n)
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
    mask = TileMasks.of(reads, spec, q.dtype).tile(0, reads.S)
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
        softcap=spec.softcap,
    )
    res = get_backend("math").fn(q, k, v, dense)
    return AttentionOutput(res.out, res.lse if spec.return_lse else None, res.weights)


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
        and (spec.softcap is None or _kernel_takes(q, H // reads.num_kv_heads, q.shape[-1]))  # the C kernel caps
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
        tables = (
            reads.decode_tables(layer, i)
            if part.kind == "decodes" and in_place and _kernel_takes(rows, H // reads.num_kv_heads, rows.shape[-1])
            else None
        )
        if part.kind in ("runs", "regions") and in_place:
            attend_part = _attend_runs if part.kind == "runs" else _attend_regions
            o, l = attend_part(reads, layer, rows, i, spec.scale, return_lse, spec.softcap)
            if len(parts) == 1 and not return_lse:  # a pure decode step: no copy back
                return AttentionOutput(o.transpose(0, 1)[None], None, None)  # (1, H, N, D), memory (N, H, D)
        elif tables is not None:
            o, l = _attend_tables(reads.num_kv_heads, rows, tables, spec.scale, return_lse, spec.softcap)
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


def _attend_regions(
    reads: PackedReads, layer: int, rows: Tensor, i: int, scale: float | None, want_lse: bool, softcap=None
):
    """Decode rows (Bd, H, D) of sequences that each start a region of R blocks and fit in it:
    region r's keys are slots [r * R * bs, r * R * bs + width) of the pool, a fixed stride
    apart, so one as_strided view (count, Hkv, width, D) of the pool holds them all, and
    one kernel call reads them (decode_attention with each slot's length, else flash with a
    length mask): no gather, one call per layer instead of one per sequence. -> (out (Bd, H, D), lse (Bd, H) or None)."""
    grid = reads.parts[i].grid
    Bd, H, D = rows.shape
    Hkv = reads.num_kv_heads
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = fold_heads(rows[:, :, None], Hkv)  # (Bd, Hkv, G, D)
    if grid.gather is not None:
        q = q.new_zeros(grid.count, Hkv, G, D).index_copy_(0, grid.gather, q)
    k, v = reads.region_views(layer, i)  # (count, Hkv, width, D)
    if _kernel_takes(q, G, D):
        # kernels/attention.py: one pass over K/V with the lengths, no mask (~2x flash, AMD EPYC Zen 3)
        lengths = _slot_lengths(reads, i)
        o, lse = kernel_attention.decode_attention(q.contiguous(), k, v, lengths, scale, want_lse, softcap)
    else:
        o, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=grid_mask(reads, i, G, q.dtype), scale=scale)[:2]
    if grid.gather is not None:
        o = o.index_select(0, grid.gather)
        lse = lse.index_select(0, grid.gather) if want_lse else None
    return o.reshape(Bd, H, D), (lse.reshape(Bd, H).float() if want_lse else None)


def _attend_tables(Hkv: int, rows: Tensor, tables, scale: float | None, want_lse: bool, softcap=None):
    """Decode rows (Bd, H, D) of sequences whose blocks lie anywhere in the pool: one kernel call
    reads every row's keys through its block table, in place, instead of gathering tiles
    (kernels.attention.paged_decode_attention; unchecked: the tables come from the cache).
    -> (out (Bd, H, D), lse (Bd, H) or None)."""
    k, v, table, lengths, bs = tables
    Bd, H, D = rows.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = fold_heads(rows[:, :, None], Hkv).contiguous()  # (Bd, Hkv, G, D)
    o, lse = kernel_attention.paged_decode_attention_unchecked(q, k, v, table, bs, lengths, scale, want_lse, softcap)
    return o.view(Bd, H, D), (lse.view(Bd, H) if want_lse else None)


def _kernel_takes(q: Tensor, G: int, D: int) -> bool:
    """Whether the decode-attention kernel reads these rows: fp32, its shapes, and built here."""
    return (
        q.dtype == torch.float32
        and kernel_attention.fits(G, D)
        and kernel_attention.decode_attention_unavailable() is None
    )


def _slot_lengths(reads: PackedReads, i: int) -> Tensor:
    """(count,) int64 keys of each region slot of part i (memoised per step: the same in every
    layer); slots without a sequence get 0 keys, their rows are dropped."""
    key = ("grid lengths", i)
    lengths = reads.mask_memo.get(key)
    if lengths is None:
        grid = reads.parts[i].grid
        lengths = torch.zeros(grid.count, dtype=torch.long)
        lengths[grid.slot] = torch.tensor(grid.lengths, dtype=torch.long)
        reads.mask_memo[key] = lengths
    return lengths


def _attend_runs(
    reads: PackedReads, layer: int, rows: Tensor, i: int, scale: float | None, want_lse: bool, softcap=None
):
    """Decode rows (Bd, H, D), each over its sequence's keys, which lie in consecutive slots
    [s0, s0 + n) of the pool: one fused-kernel call per sequence on a view of the pool,
    nothing gathered, no mask (a decode token sees every key of its sequence), no
    log-sum-exp merging; the G query heads of a KV group are G rows (GQA, no K/V copy).
    Copying a 256-token sequence's K/V out and reading it back costs more than the
    ~20 us of dispatch per call. -> (out (Bd, H, D), lse (Bd, H) or None)."""
    Bd, H, D = rows.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    views = reads.run_views(i)  # Bd x (K, V) (L, 1, Hkv, n, D)
    q = fold_heads(rows[:, :, None], reads.num_kv_heads)  # (Bd, Hkv, G, D)
    if _kernel_takes(q, q.shape[2], D):
        # kernels/attention.py: a view's keys are all the sequence's; one pass, no flash buffers
        q = q.contiguous()
        res = [
            kernel_attention.decode_attention_all_keys(q[b : b + 1], k[layer], v[layer], scale, want_lse, softcap)
            for b, (k, v) in enumerate(views)
        ]
    else:
        res = [_CPU_FLASH(qb, k[layer], v[layer], 0.0, False, scale=scale) for qb, (k, v) in zip(q.split(1), views)]
    o = torch.cat([r[0] for r in res]).view(Bd, H, D)
    lse = torch.cat([r[1] for r in res]).view(Bd, H).float() if want_lse else None
    return o, lse
