"""The additive masks of the `paged` backend (paged.py), built per key tile and memoised per step.

- `TileMasks`: the mask of a key tile [k0, k1) for some batch rows of a padded step
  (validity past a sequence's end, causality, sliding window, key padding, attn_mask, ALiBi), or None when
  those rows see every key of the tile;
- `tile_mask`: that mask folded for the G query heads of a KV group, with the rows that see
  no key, memoised when it depends on validity, causality and window alone (the same in every
  layer of one window);
- `grid_mask`: the length mask of a packed step's "regions" part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv import BlockReads, PackedReads, Tile, fold_mask
from ..spec import AttentionSpec

NEG_INF = float("-inf")


class TileMasks:
    """Builds the additive mask of any key tile [k0, k1) for some batch rows, or None when
    each of those query rows sees every key of the tile (a decode step over past keys)."""

    def __init__(self, reads: BlockReads, is_causal, attn_mask, key_padding_mask, alibi_slopes, H, dtype, window=None):
        self.reads, self.is_causal, self.H = reads, bool(is_causal), H
        self.window = window  # (left, right) or None: keys at positions [p - left, p + right] of query p
        self.attn_mask, self.kpm, self.alibi = attn_mask, key_padding_mask, alibi_slopes
        self.plain = attn_mask is None and key_padding_mask is None and alibi_slopes is None
        # Biases (ALiBi, float masks) stay fp32: rounded to fp16/bf16, slope * distance loses
        # ~3 digits. A mask whose dtype differs from q's sends the tile to the fp32 matmul kernel.
        has_bias = alibi_slopes is not None or (attn_mask is not None and attn_mask.dtype != torch.bool)
        self.dtype = torch.float32 if has_bias and dtype in (torch.float16, torch.bfloat16) else dtype

    @classmethod
    def of(cls, reads: BlockReads, spec: AttentionSpec, dtype) -> TileMasks:
        return cls(
            reads, spec.is_causal, spec.attn_mask, spec.key_padding_mask, spec.alibi_slopes, spec.H, dtype, spec.window
        )

    def first_key(self, rows: slice = slice(None)) -> int:
        """The first key position any query of these rows sees through the window (0 without one)."""
        return 0 if self.window is None else max(0, min(self.reads.starts[rows]) - self.window[0])

    def outside_window(self, k0: int, k1: int, rows: slice = slice(None)) -> bool:
        """Whether no query of these rows sees any key of [k0, k1) through the window: a tile
        (and its blocks, which the cache may have freed) not to read at all."""
        if self.window is None:
            return False
        left, right = self.window
        starts = self.reads.starts[rows]
        return k1 - 1 < min(starts) - left or k0 > max(starts) + self.reads.T - 1 + right

    def tile(self, k0: int, k1: int, rows: slice = slice(None)) -> Tensor | None:
        reads, dev = self.reads, self.reads.device
        need_valid = k1 > min(reads.ends[rows])  # keys past a sequence's end are padding
        need_causal = self.is_causal and k1 - 1 > min(reads.starts[rows])
        need_window = self.window is not None and (
            k0 < max(reads.starts[rows]) + reads.T - 1 - self.window[0]
            or k1 - 1 > min(reads.starts[rows]) + self.window[1]
        )
        if not (
            need_valid
            or need_causal
            or need_window
            or self.attn_mask is not None
            or self.kpm is not None
            or self.alibi is not None
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
        if need_window:  # Mistral / Gemma sliding windows, at each row's true positions
            rel = pos[:, :, None] - kpos  # (b, T, n): > 0 means the key is in the past
            w = ((rel <= self.window[0]) & (rel >= -self.window[1]))[:, None]  # (b, 1, T, n)
            allowed = w if allowed is None else allowed & w
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


def tile_mask(reads: BlockReads, seg: Tile, rows: slice, masks: TileMasks, folded: bool, Hkv: int, G: int):
    """(mask (B|1, 1|Hkv, G*T, n) or (B|1, 1|H, T, n) or None, rows with no visible key or None).
    Masks made of validity and causality alone are the same in every layer: memoised per step."""
    key = (
        (seg.k0, seg.k1, rows.start, rows.stop, folded, Hkv, G, masks.H, masks.is_causal, masks.dtype, masks.window)
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


def grid_mask(reads: PackedReads, i: int, G: int, dtype) -> Tensor:
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
