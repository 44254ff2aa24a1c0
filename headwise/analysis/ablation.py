"""Ablation: take heads out and measure quality, in importance order vs random orders.

A head is removed by zeroing its output z_h (what pruning it does) or by replacing z_h
with its mean over a corpus (mean ablation: keeps the average signal the next layers
expect, so it isolates what the head adds per token). Heads are removed

  - in global importance order (Michel et al. 2019's normalized scores, least first),
  - per layer: the same fraction of the least important heads in every layer,
  - in random orders (several seeds), the baseline the importance order must beat,

and the last remaining head of a layer is never taken (pruning cannot remove a whole
layer's attention, and Michel et al. keep one too), so the largest fraction is
1 - layers/heads. The curves give, per order, the largest fraction of heads removed
before quality drops by 1% / 5% (the metric's `drop`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor, nn

from .capture import Batch
from .hooks import Capture, attached, heads_per_layer
from .importance import Importance
from .metrics import Metric

FRACTIONS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
THRESHOLDS = (0.01, 0.05)


def take(order: Sequence[tuple[int, int]], k: int, hpl: Sequence[int]) -> set[tuple[int, int]]:
    """The first k heads of `order` that leave every layer at least one head."""
    left = list(hpl)
    out = set()
    for l, h in order:
        if len(out) == k:
            break
        if left[l] > 1:
            out.add((l, h))
            left[l] -= 1
    return out


def per_layer_set(importance: Importance, fraction: float) -> set[tuple[int, int]]:
    """round(fraction * H_l) least important heads of every layer (at most H_l - 1)."""
    out = set()
    for l, scores in enumerate(importance.raw):
        H = len(scores)
        k = min(H - 1, round(fraction * H))
        out |= {(l, int(h)) for h in scores.argsort()[:k]}
    return out


def masks_for(removed: set[tuple[int, int]], hpl: Sequence[int]) -> list[Tensor]:
    masks = [torch.ones(h) for h in hpl]
    for l, h in removed:
        masks[l][h] = 0.0
    return masks


@torch.no_grad()
def mean_outputs(model: nn.Module, batches: Sequence[Batch]) -> list[Tensor]:
    """Each head's output z averaged over the real tokens of `batches`: (H, D) per layer."""
    sums, count = None, 0
    for b in batches:
        cap = Capture(("z",))
        with attached(model, capture=cap):
            from .capture import forward

            forward(model, b)
        v = b.valid[:, None, :, None].float()  # (B, 1, T, 1)
        zs = [(cap.z[l].float() * v).sum((0, 2)) for l in range(len(cap.z))]  # (H, D)
        sums = zs if sums is None else [s + z for s, z in zip(sums, zs)]
        count += int(b.valid.sum())
    return [s / max(count, 1) for s in sums]


@dataclass
class Curves:
    fractions: list[float]
    baseline: dict
    metric: str
    unit: str
    curves: dict[str, list[dict]] = field(default_factory=dict)  # name -> [result per fraction]

    def drops(self, name: str, key: str = "drop") -> list[float]:
        return [r[key] for r in self.curves[name]]

    def removable(self, name: str, threshold: float, key: str = "drop") -> float:
        """Largest fraction of heads removed such that the drop stays <= threshold at every
        tested fraction up to it (0 when the first one already drops more)."""
        best = 0.0
        for r in self.curves[name]:
            if r[key] > threshold:
                break
            best = r["fraction_removed"]
        return best

    def drop_keys(self) -> list[str]:
        first = next(iter(self.curves.values()))[0]
        return [k for k in first if k.startswith("drop")]

    def summary(self) -> dict:
        """{drop key: {"1%": {order: fraction}, "5%": ...}}; random orders as median, min, max."""
        out = {}
        names = list(self.curves)
        for key in self.drop_keys():
            per = {}
            for t in THRESHOLDS:
                row = {n: self.removable(n, t, key) for n in names if not n.startswith("random")}
                rand = sorted(self.removable(n, t, key) for n in names if n.startswith("random"))
                if rand:
                    row["random_median"] = rand[len(rand) // 2]
                    row["random_min"], row["random_max"] = rand[0], rand[-1]
                per[f"{t:.0%}"] = row
            out[key] = per
        return out

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "unit": self.unit,
            "fractions": self.fractions,
            "baseline": self.baseline,
            "curves": self.curves,
            "removable": self.summary(),
        }


def ablation_curves(
    model: nn.Module,
    metric: Metric,
    importance: Importance,
    *,
    fractions: Sequence[float] = FRACTIONS,
    seeds: int = 3,
    means: list[Tensor] | None = None,
    per_layer: bool = True,
    progress=None,
) -> Curves:
    """Quality vs fraction of heads removed, for every order (see the module docstring).
    With `means`, the importance order is also run with mean ablation."""
    hpl = heads_per_layer(model)
    N = sum(hpl)
    baseline = metric.evaluate(model)
    metric.baseline = baseline
    cv = Curves(list(fractions), baseline, metric.name, metric.unit)
    orders = {"importance": importance.order()}
    for s in range(seeds):
        o = [(l, h) for l, H in enumerate(hpl) for h in range(H)]
        random.Random(s).shuffle(o)
        orders[f"random{s}"] = o
    jobs = []
    for f in fractions:
        k = round(f * N)
        jobs.append(("importance", f, take(orders["importance"], k, hpl), None))
        if per_layer:
            jobs.append(("importance_per_layer", f, per_layer_set(importance, f), None))
        if means is not None:
            jobs.append(("importance_mean_ablation", f, take(orders["importance"], k, hpl), means))
        for s in range(seeds):
            jobs.append((f"random{s}", f, take(orders[f"random{s}"], k, hpl), None))
    for name, f, removed, replace in jobs:
        r = metric.evaluate(model, mask=masks_for(removed, hpl), replace=replace)
        r["drop"] = metric.drop(r)
        r |= metric.extra_drops(r)
        r["removed"] = len(removed)
        r["fraction_removed"] = len(removed) / N
        cv.curves.setdefault(name, []).append(r)
        if progress is not None:
            progress.update(1)
    return cv


def count_jobs(fractions: Sequence[float], seeds: int, means: bool, per_layer: bool) -> int:
    return len(fractions) * (1 + seeds + int(means) + int(per_layer))
