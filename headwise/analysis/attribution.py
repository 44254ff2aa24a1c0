"""Attention weights beside what the attended tokens actually contribute.

A head's output for query i is sum_j a_ij f(x_j), f(x_j) = W_O^h (W_V^h x_j + b_V^h):
the weight a_ij only says how much of f(x_j) is taken, and f(x_j) can be tiny.
Kobayashi et al. 2020 ("Attention is not only a weight", EMNLP) measure the
contribution as the norm ||a_ij f(x_j)|| and find BERT's heavy attention to [CLS],
[SEP] and punctuation carries vectors with small norms. `hint_gaps` turns that into a
per-head measurement: how much of the output's norm budget a row's most attended
token really gets, against the share of weight it gets.

Attention rollout (Abnar & Zuidema 2020, "Quantifying attention flow in
transformers") follows attention through the layers: each layer's head-averaged
weights, with the residual connection added as an identity (0.5 A + 0.5 I, rows
renormalized), multiplied from the first layer to the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from ..attention import MultiHeadAttention

HINT_RATIO = 0.5  # flag a head when its top tokens get < half the norm share their weight suggests


def value_norms(layer: MultiHeadAttention, v: Tensor) -> Tensor:
    """||f_h(x_j)|| for every query head h and key j: v (B, Hkv, S, D) as captured -> (B, H, S).
    Query head h reads KV head kv_of(h), as in `attend` (or `kv_map` after uneven pruning,
    in which case the captured v already has one KV head per query head)."""
    B, Hkv, S, D = v.shape
    H = layer.num_heads
    kv_of = torch.arange(H) // (H // Hkv) if Hkv != H else torch.arange(H)
    w_o = layer.projection_weights()[3].view(layer.d_model, H, D)  # (C, H, D)
    f = torch.einsum("bhsd,chd->bhsc", v.index_select(1, kv_of.to(v.device)).float(), w_o.float())
    return f.norm(dim=-1)  # (B, H, S)


def weighted_norms(pattern: Tensor, fnorm: Tensor) -> Tensor:
    """||a_ij f(x_j)|| = a_ij ||f(x_j)||: pattern (B, H, T, S), fnorm (B, H, S) -> (B, H, T, S)."""
    return pattern.float() * fnorm[:, :, None, :]


@dataclass
class HintGaps:
    """Per layer, (H,) tensors: the mean over rows of the weight a row's most attended key
    gets, the share of the row's summed norms sum_j ||a_ij f(x_j)|| that key gets, and
    their ratio (1: the weight tells the truth; << 1: the top token is a hint, not an
    explanation). `flagged` marks ratio < HINT_RATIO."""

    top_weight: list[Tensor]
    top_norm_share: list[Tensor]

    @property
    def ratio(self) -> list[Tensor]:
        return [n / w.clamp_min(1e-9) for n, w in zip(self.top_norm_share, self.top_weight)]

    @property
    def flagged(self) -> list[Tensor]:
        return [r < HINT_RATIO for r in self.ratio]

    def to_json(self) -> dict:
        return {
            "threshold_ratio": HINT_RATIO,
            "top_weight": [[round(float(x), 4) for x in t] for t in self.top_weight],
            "top_norm_share": [[round(float(x), 4) for x in t] for t in self.top_norm_share],
            "ratio": [[round(float(x), 4) for x in t] for t in self.ratio],
            "flagged": [[bool(x) for x in t] for t in self.flagged],
        }


class HintAccumulator:
    """Feeds `HintGaps` batch by batch from captured patterns and values."""

    def __init__(self, heads_per_layer: Sequence[int]):
        self.w = [torch.zeros(h, dtype=torch.float64) for h in heads_per_layer]
        self.n = [torch.zeros(h, dtype=torch.float64) for h in heads_per_layer]
        self.rows = [torch.zeros(h, dtype=torch.float64) for h in heads_per_layer]

    @torch.no_grad()
    def add(self, layer_index: int, layer: MultiHeadAttention, pattern: Tensor, v: Tensor, valid: Tensor) -> None:
        a = pattern.float()  # (B, H, T, S)
        contrib = weighted_norms(a, value_norms(layer, v))  # (B, H, T, S)
        top = a.argmax(-1, keepdim=True)  # (B, H, T, 1)
        w = a.gather(-1, top)[..., 0]
        share = contrib.gather(-1, top)[..., 0] / contrib.sum(-1).clamp_min(1e-12)
        rows = valid[:, None, :].expand_as(w) & (a.sum(-1) > 0)  # real rows that saw a key
        self.w[layer_index] += torch.where(rows, w, 0).sum((0, 2)).double()
        self.n[layer_index] += torch.where(rows, share, 0).sum((0, 2)).double()
        self.rows[layer_index] += rows.sum((0, 2)).double()

    def result(self) -> HintGaps:
        return HintGaps(
            [(w / c.clamp_min(1)).float() for w, c in zip(self.w, self.rows)],
            [(n / c.clamp_min(1)).float() for n, c in zip(self.n, self.rows)],
        )


def rollout(patterns: Sequence[Tensor], valid: Tensor | None = None, residual: float = 0.5) -> Tensor:
    """Attention rollout over layers: patterns L x (B, H, T, T) -> (B, T, T), row i = how much
    the last layer's token i draws on each input token. Padding rows/keys are dropped from
    the identity so they do not leak mass."""
    B, _, T, _ = patterns[0].shape
    eye = torch.eye(T).expand(B, T, T)
    if valid is not None:
        eye = eye * valid[:, None, :].float()
    out = None
    for p in patterns:
        a = residual * eye + (1 - residual) * p.float().mean(dim=1)  # (B, T, T)
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
        out = a if out is None else a @ out
    return out


@torch.no_grad()
def attribute(model: nn.Module, batch, *, layers: Sequence[int] | None = None) -> dict:
    """Patterns, value-weighted norms (row-normalized to sum 1 like the weights) and rollout
    for one batch: {"pattern": {l: (B,H,T,S)}, "norms": {l: ...}, "rollout": (B,T,T)}."""
    from .capture import capture
    from .hooks import attention_layers

    batch, cap = capture(model, batch, points=("pattern", "v"), layers=layers)
    attn = attention_layers(model)
    norms = {}
    for l, p in cap.pattern.items():
        c = weighted_norms(p, value_norms(attn[l], cap.v[l]))
        norms[l] = c / c.sum(-1, keepdim=True).clamp_min(1e-12)
    roll = rollout([cap.pattern[l] for l in sorted(cap.pattern)], batch.valid) if layers is None else None
    return {"batch": batch, "pattern": cap.pattern, "norms": norms, "rollout": roll}
