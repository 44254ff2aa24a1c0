"""Role labels for heads, each with the score behind it, from attention patterns over a corpus.

A head can carry several labels or none: the scores are the result, the labels only
mark scores above a threshold. Every score is an average over real query rows
(padding excluded) of the fraction of attention a row gives in some way:

  previous / next   mass on the key at offset -1 / +1 (Voita et al. 2019, "positional heads")
  offset            the largest mass at one fixed offset k, |k| >= 2 or k = 0 (self), and which k
  local             mass within +-LOCAL_WINDOW tokens beyond the single strongest offset
                    there, so a pure previous-token head is not also "local"
  long_range        mass away from sinks times how far it reaches: non-sink mass x
                    min(1, mean distance / (2 x the mean distance of uniform attention));
                    the report also gives the mean attention distance in tokens
  broad             entropy of the row / log(number of visible keys): 1 = uniform
                    (Clark et al. 2019, "What does BERT look at?", broad heads)
  sink              mass on the first token and special tokens ([CLS], [SEP], BOS)
                    (Clark et al. 2019; Xiao et al. 2023, attention sinks)
  induction         on random token sequences repeated twice, mass a token in the second
                    copy puts on the token that followed its first occurrence
                    (Olsson et al. 2022, "In-context learning and induction heads")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from .capture import Batch, capture, from_ids, is_causal

MAX_OFFSET = 8  # offsets -8..8 are scored
LOCAL_WINDOW = 3  # "local" = within 3 tokens either side
MIN_KEYS = 4  # rows that see fewer (non-sink) keys say nothing about breadth or reach
THRESHOLDS = {
    "previous": 0.4,
    "next": 0.4,
    "offset": 0.4,
    "local": 0.4,
    "long_range": 0.6,
    "broad": 0.75,
    "sink": 0.5,
    "induction": 0.3,
}
ROLES = tuple(THRESHOLDS)


class PatternStats:
    """Running sums of the per-row statistics of every head, fed one layer's pattern at a time."""

    SHAPES = {
        "offsets": (2 * MAX_OFFSET + 1,),
        "local": (),
        "sink": (),
        "broad": (),
        "long_range": (),
        "distance": (),
    }  # per head

    def __init__(self, heads_per_layer: Sequence[int], causal: bool):
        self.causal = causal
        self.sums = {
            n: [torch.zeros(h, *s, dtype=torch.float64) for h in heads_per_layer] for n, s in self.SHAPES.items()
        }
        self.counts = {
            n: [torch.zeros(h, *s, dtype=torch.float64) for h in heads_per_layer] for n, s in self.SHAPES.items()
        }

    def _acc(self, name: str, layer: int, values: Tensor, rows: Tensor) -> None:
        """values (B, h, ...) at rows (B, 1|h, ...) bool -> per-head sums and counts."""
        rows = rows.expand_as(values)
        dims = (0, values.dim() - 1)
        self.sums[name][layer] += torch.where(rows, values, 0).sum(dims).double()
        self.counts[name][layer] += rows.sum(dims).double()

    def mean(self, name: str) -> list[Tensor]:
        return [(s / c.clamp_min(1)).float() for s, c in zip(self.sums[name], self.counts[name])]

    @torch.no_grad()
    def add(self, layer: int, pattern: Tensor, valid: Tensor, sinks: Tensor, window: int | None = None) -> None:
        """pattern (B, H, T, T) of one layer (self-attention, no cache), valid (B, T), sinks (B, T);
        window: the layer's W (keys each query sees, its own included), None = global. Keys
        outside it are not visible, so breadth and reach compare with what the head could see."""
        B, H, T, S = pattern.shape
        a = pattern.float()
        pos = torch.arange(T)
        d = pos[None, :] - pos[:, None]  # (T, S): key - query offset
        visible = valid[:, None, :] & valid[:, :, None]  # (B, T, S)
        if self.causal:
            visible = visible & (d <= 0)
        if window is not None:  # attend()'s window: keys p - (W - 1) .. p (.. p + W - 1 if not causal)
            visible = visible & (d.abs() < window)
        rows = valid[:, None, :]  # (B, 1, T)
        n_vis = visible.sum(-1)[:, None]  # (B, 1, T)
        nonsink = visible & ~sinks[:, None, :]
        n_ns = nonsink.sum(-1)[:, None]

        offs = torch.stack([self._at_offset(a, k) for k in range(-MAX_OFFSET, MAX_OFFSET + 1)], dim=2)
        ok = torch.stack(
            [self._at_offset(visible[:, None].float(), k) for k in range(-MAX_OFFSET, MAX_OFFSET + 1)], dim=2
        ).bool()  # (B, 1, K, T)
        self._acc("offsets", layer, offs, ok & rows[:, :, None])  # (B, H, K, T)

        band = d.abs() <= LOCAL_WINDOW
        local = (a * band).sum(-1) - (a * band).amax(-1)  # beyond the strongest offset
        self._acc("local", layer, local, rows & (n_vis > 2))

        self._acc("sink", layer, (a * sinks[:, None, None, :]).sum(-1), rows & (n_ns > 0))

        ent = -(a * a.clamp_min(1e-30).log()).sum(-1) / n_vis.clamp_min(2).log()
        self._acc("broad", layer, ent, rows & (n_vis >= MIN_KEYS))

        dist = d.abs().float()
        m = (a * nonsink[:, None]).sum(-1)  # (B, H, T) non-sink mass
        reach = (a * nonsink[:, None] * dist).sum(-1) / m.clamp_min(1e-9)
        uniform = (nonsink * dist).sum(-1)[:, None] / n_ns.clamp_min(1)
        score = m * (reach / (2 * uniform.clamp_min(1e-9))).clamp(max=1.0)
        self._acc("long_range", layer, score, rows & (n_ns >= MIN_KEYS))
        self._acc("distance", layer, (a * dist).sum(-1), rows & (n_vis > 1))

    @staticmethod
    def _at_offset(a: Tensor, k: int) -> Tensor:
        """a[..., i, i + k] padded to length T with zeros -> (..., T)."""
        diag = torch.diagonal(a, offset=k, dim1=-2, dim2=-1)  # (..., T - |k|)
        pad = (0, abs(k)) if k >= 0 else (abs(k), 0)
        return nn.functional.pad(diag, pad)


@dataclass
class HeadRoles:
    """Scores (L lists of (H,) tensors, one per role) and the labels they give."""

    scores: dict[str, list[Tensor]]
    offset_k: list[Tensor]  # the k behind each head's "offset" score
    mean_distance: list[Tensor]  # mean attention distance in tokens
    thresholds: dict[str, float] = field(default_factory=lambda: dict(THRESHOLDS))

    def labels(self, layer: int, head: int) -> list[str]:
        out = []
        for role in ROLES:
            if role in self.scores and float(self.scores[role][layer][head]) >= self.thresholds[role]:
                out.append(f"offset {int(self.offset_k[layer][head]):+d}" if role == "offset" else role)
        return out

    def score(self, role: str, layer: int, head: int) -> float:
        return float(self.scores[role][layer][head])

    def to_json(self) -> dict:
        L = len(self.offset_k)
        return {
            "thresholds": self.thresholds,
            "heads": [
                [
                    {
                        "labels": self.labels(l, h),
                        "scores": {r: round(self.score(r, l, h), 4) for r in self.scores},
                        "offset_k": int(self.offset_k[l][h]),
                        "mean_distance": round(float(self.mean_distance[l][h]), 3),
                    }
                    for h in range(len(self.offset_k[l]))
                ]
                for l in range(L)
            ],
        }


def induction_batch(
    model: nn.Module, *, n: int = 32, rows: int = 4, seed: int = 0, vocab: tuple[int, int] | None = None
) -> tuple[Batch, int]:
    """Random token sequences repeated twice, framed like the model's texts ([CLS] ... [SEP]
    for BERT; nothing for SmolLM2). Tokens are distinct within a sequence, so each has one
    earlier occurrence. Returns the batch and the position where the first copy starts."""
    tok = getattr(model, "tokenizer", None)
    V = model.config.vocab_size if hasattr(model, "config") else None
    lo, hi = vocab or (min(2000, (V or 64) // 4), V)
    if hi is None:
        raise ValueError("induction_batch needs vocab=(lo, hi) for a model without a config")
    special = set(tok.special_token_ids) if tok is not None else set()
    frame = tok.encode("") if tok is not None else []
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = []
        while len(ids) < n:  # distinct, no special tokens
            for t in (torch.randperm(hi - lo, generator=g)[: 2 * n] + lo).tolist():
                if t not in special and t not in ids and len(ids) < n:
                    ids.append(t)
        out.append(frame[:1] + ids + ids + frame[1:])
    return from_ids(out, pad_id=(tok.pad_token_id or 0) if tok else 0, special=special), len(frame[:1])


def induction_scores(pattern: Tensor, start: int, n: int) -> Tensor:
    """(B, H, T, T) pattern on induction_batch -> (H,) mean mass from the second copy's
    token t onto the first copy's token t + 1."""
    q = torch.arange(start + n, start + 2 * n - 1)  # second copy, t = 0..n-2
    k = q - n + 1
    return pattern[:, :, q, k].float().mean(dim=(0, 2))


@torch.no_grad()
def head_roles(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    induction: bool = True,
    n_induction: int = 32,
    seed: int = 0,
    vocab: tuple[int, int] | None = None,
    progress=None,
    hints=None,
) -> HeadRoles:
    """Score every head of `model` on `batches` (and on repeated random tokens for induction,
    drawn from ids [vocab[0], vocab[1]); default: the model's vocabulary past its first ids).
    hints: an `attribution.HintAccumulator` fed from the same forward passes."""
    from .hooks import attention_layers, heads_per_layer

    hpl = heads_per_layer(model)
    layers = attention_layers(model)
    stats = PatternStats(hpl, is_causal(model))
    for batch in batches:
        _, cap = capture(model, batch, points=("pattern", "v") if hints is not None else ("pattern",))
        for l, p in cap.pattern.items():
            stats.add(l, p, batch.valid, batch.sinks, layers[l].window)
            if hints is not None:
                hints.add(l, layers[l], p, cap.v[l], batch.valid)
        if progress is not None:
            progress.update(1)
    offs = stats.mean("offsets")  # (H, 2K+1) per layer
    K = MAX_OFFSET
    scores = {"previous": [o[:, K - 1] for o in offs], "next": [o[:, K + 1] for o in offs]}
    other = [k for k in range(-K, K + 1) if abs(k) != 1]
    cols = torch.tensor([k + K for k in other])
    best, arg = zip(*[o[:, cols].max(dim=1) for o in offs])
    scores["offset"] = list(best)
    offset_k = [torch.tensor(other)[a] for a in arg]
    for name in ("local", "long_range", "broad", "sink"):
        scores[name] = stats.mean(name)
    if induction:
        ib, start = induction_batch(model, n=n_induction, seed=seed, vocab=vocab)
        _, cap = capture(model, ib, points=("pattern",))
        scores["induction"] = [induction_scores(cap.pattern[l], start, n_induction) for l in range(len(hpl))]
        if progress is not None:
            progress.update(1)
    return HeadRoles(scores, offset_k, stats.mean("distance"))


def role_map(roles: HeadRoles) -> list[list[str]]:
    """The strongest label of every head ("" for none), for the layers x heads picture."""
    out = []
    for l in range(len(roles.offset_k)):
        row = []
        for h in range(len(roles.offset_k[l])):
            labels = roles.labels(l, h)
            if not labels:
                row.append("")
                continue
            by_margin = max(labels, key=lambda lab: _margin(roles, lab, l, h))
            row.append(by_margin)
        out.append(row)
    return out


def _margin(roles: HeadRoles, label: str, l: int, h: int) -> float:
    role = "offset" if label.startswith("offset") else label
    return roles.score(role, l, h) / roles.thresholds[role]
