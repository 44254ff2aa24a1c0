"""Head importance (Michel, Levy & Neubig 2019, "Are sixteen heads really better than one?").

Every head's output is multiplied by a gate xi_h (1 = the model as it is). Importance
is the expected absolute gradient of the loss with respect to the gate,

    I_h = E_x | dL(x) / d xi_h |,

a first-order estimate of how much the loss changes when the head is removed. The
gates are (B, H) per layer, one row per example: example b only reads row b, so one
backward pass gives every example's own gradient, and the absolute value is taken per
example, as the formula says (the reference implementation takes it per batch).
Scores are also given normalized per layer (l2 norm 1), as Michel et al. do before
ranking heads across layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from .capture import Batch
from .hooks import attached, heads_per_layer
from .metrics import embeddings, example_losses


@dataclass
class Importance:
    raw: list[Tensor]  # per layer (H,): E_x |dL/dxi_h|
    examples: int

    @property
    def normalized(self) -> list[Tensor]:
        return [r / r.norm().clamp_min(1e-12) for r in self.raw]

    def flat(self, normalized: bool = True) -> list[tuple[float, int, int]]:
        """(score, layer, head) for every head."""
        src = self.normalized if normalized else self.raw
        return [(float(s), l, h) for l, t in enumerate(src) for h, s in enumerate(t)]

    def order(self, normalized: bool = True) -> list[tuple[int, int]]:
        """Heads from least to most important."""
        return [(l, h) for _, l, h in sorted(self.flat(normalized))]

    def to_json(self) -> dict:
        return {
            "examples": self.examples,
            "raw": [[float(x) for x in t] for t in self.raw],
            "normalized": [[round(float(x), 5) for x in t] for t in self.normalized],
        }


def head_importance(model: nn.Module, batches: Iterable[Batch], *, progress=None) -> Importance:
    """Michel et al.'s importance of every head over `batches` (loss: `metrics.example_losses`)."""
    hpl = heads_per_layer(model)
    total = [torch.zeros(h, dtype=torch.float64) for h in hpl]
    n = 0
    for batch in batches:
        target = None
        if not getattr(model.config, "causal", True):
            with torch.no_grad():
                target = embeddings(model, batch)
        gates = [torch.ones(len(batch), h, requires_grad=True) for h in hpl]  # (B, H) per layer
        with torch.enable_grad(), attached(model, mask=gates):
            losses = example_losses(model, batch, target)  # (B,)
            grads = torch.autograd.grad(losses.sum(), gates)
        for l, g in enumerate(grads):
            total[l] += g.abs().sum(0).double()
        n += len(batch)
        if progress is not None:
            progress.update(1)
    if n == 0:
        raise ValueError("no examples to score head importance on")
    return Importance([(t / n).float() for t in total], n)


def loss_with_gates(model: nn.Module, batch: Batch, gates: Sequence[Tensor], target=None) -> Tensor:
    """(B,) per-example losses with head gates (H,) or (B, H) per layer: for checks and curves."""
    with attached(model, mask=list(gates)):
        return example_losses(model, batch, target)
