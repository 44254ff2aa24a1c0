"""Masks and biases, built for any tile of the (T, S) score matrix.

Every backend uses `tile_masks` so that causal, sliding-window, padding, user
masks and ALiBi mean exactly the same thing everywhere. A tile is query rows
[q0, q1) against keys [k0, k1); the math backend asks for the whole matrix,
`chunked` for one tile at a time, so no backend needs O(T*S) memory for masks
it can build on the fly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .spec import AttentionSpec


def tile_masks(
    spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Return (allowed, bias) for a tile, each broadcastable to (B, H, q1-q0, k1-k0).

    allowed: bool, True where the query may attend the key (None = all allowed).
    bias:    fp32 added to the scaled scores (None = no bias).
    """
    allowed = None
    bias = None
    first_q, last_q = q0 + spec.q_offset, q1 - 1 + spec.q_offset  # absolute positions (bottom-right)
    causal = spec.is_causal and k1 - 1 > first_q  # some key in the tile is in some query's future
    window = spec.window is not None and (k0 < last_q - spec.window[0] or k1 - 1 > first_q + spec.window[1])
    if causal or window or spec.alibi_slopes is not None:
        qpos = torch.arange(first_q, last_q + 1, device=device)
        kpos = torch.arange(k0, k1, device=device)
        rel = qpos[:, None] - kpos[None, :]  # (tq, tk): > 0 means key is in the past
        if causal:
            allowed = rel >= 0
        if window:
            left, right = spec.window
            in_window = (rel <= left) & (rel >= -right)
            allowed = in_window if allowed is None else allowed & in_window
        if spec.alibi_slopes is not None:
            # ALiBi (Press et al. 2022): -slope * distance, as flash-attn defines it (|i - j|).
            slopes = spec.alibi_slopes[:, :, None, None]  # (B|1, H, 1, 1)
            bias = -slopes * rel.abs().to(torch.float32)
    if spec.key_padding_mask is not None:
        keep = ~spec.key_padding_mask[:, None, None, k0:k1]  # (B, 1, 1, tk)
        allowed = keep if allowed is None else allowed & keep
    if spec.attn_mask is not None:
        m = spec.attn_mask[:, :, q0:q1, k0:k1]
        if m.dtype == torch.bool:
            allowed = m if allowed is None else allowed & m
        else:
            m = m.to(torch.float32)
            bias = m if bias is None else bias + m
    return allowed, bias


def tile_is_empty(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> bool:
    """True when causal/window structure alone masks the whole tile (skip it)."""
    first_q, last_q = q0 + spec.q_offset, q1 - 1 + spec.q_offset
    if spec.is_causal and k0 > last_q:
        return True
    if spec.window is not None:
        left, right = spec.window
        if k1 - 1 < first_q - left or k0 > last_q + right:
            return True
    return False


def alibi_slopes(num_heads: int) -> Tensor:
    """Head slopes from the ALiBi paper: a geometric sequence starting at 2^(-8/n).

    For head counts that are not a power of two, interleave the slopes of the next
    power of two, as the reference implementation does (Press et al. 2022, §3).
    """

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def causal_mask(T: int, S: int | None = None, device=None) -> Tensor:
    """Bool (T, S) mask, True = may attend, aligned bottom-right (query i at S - T + i)."""
    S = T if S is None else S
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)
