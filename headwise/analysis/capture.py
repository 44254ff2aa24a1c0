"""Attention patterns and per-head outputs for a batch of texts, on any headwise model.

    b, cap = capture(model, ["The bank approved the loan."], points=("pattern", "result"))
    cap.pattern[2]       # layer 2: (B, H, T, T) fp32, exact weights rebuilt from the fused LSE
    b.tokens[0]          # the token strings, for plots

Texts are tokenized with the model's own tokenizer and right-padded; padding is masked
as a key everywhere, and the `valid` mask says which query rows are real. Decoders
(`config.causal`) run causally and return next-token logits; encoders return hidden
states. `sinks` marks the tokens attention sinks sit on: the first token of every
row and the tokenizer's special tokens ([CLS], [SEP], BOS, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from .hooks import Capture, attached


@dataclass
class Batch:
    """Token ids for a batch of texts, right-padded."""

    ids: Tensor  # (B, T) long
    mask: Tensor  # (B, T) long: 1 = token, 0 = padding (HF's attention_mask)
    tokens: list[list[str]]  # the B rows' token strings, padding left out
    sinks: Tensor  # (B, T) bool: first token or special token

    @property
    def valid(self) -> Tensor:
        return self.mask.bool()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def slice(self, start: int, stop: int) -> "Batch":
        T = int(self.mask[start:stop].sum(1).max())  # drop columns that are padding in every row
        return Batch(
            self.ids[start:stop, :T], self.mask[start:stop, :T], self.tokens[start:stop], self.sinks[start:stop, :T]
        )


def is_causal(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "causal", False))


def encode(model: nn.Module, texts: str | Sequence[str], *, max_length: int | None = None) -> Batch:
    """Tokenize with `model.tokenizer` (special tokens as the model expects them), truncate to
    max_length (keeping a final [SEP] for encoders) and right-pad."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError("no texts to encode")
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"{type(model).__name__} has no tokenizer; pass token ids with `Batch.from_ids`")
    rows = []
    for t in texts:
        ids = tok.encode(t)
        if max_length is not None and len(ids) > max_length:
            ids = ids[:max_length] if is_causal(model) else ids[: max_length - 1] + [ids[-1]]
        if not ids:
            raise ValueError(f"text {t!r} has no tokens")
        rows.append(ids)
    special = tok.special_token_ids
    return from_ids(rows, pad_id=tok.pad_token_id or 0, special=special, tokens=[token_texts(tok, r) for r in rows])


def token_texts(tok, ids: Sequence[int]) -> list[str]:
    """Readable token strings: each id decoded on its own (" bank", not the BPE symbol "Ġbank")."""
    return [tok.decode([i]) or tok.id_to_token(i) or str(i) for i in ids]


def from_ids(
    rows: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    special: Sequence[int] = (),
    tokens: list[list[str]] | None = None,
) -> Batch:
    """A right-padded Batch from lists of token ids (a model without a tokenizer)."""
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[b, : len(r)] = 1
    sinks = torch.zeros(B, T, dtype=torch.bool)
    sinks[:, 0] = True
    if special:
        sinks |= torch.isin(ids, torch.as_tensor(sorted(special), dtype=torch.long)) & mask.bool()
    tokens = tokens or [[str(i) for i in r] for r in rows]
    return Batch(ids, mask, tokens, sinks)


def forward(model: nn.Module, batch: Batch) -> Tensor:
    """One forward pass: logits (B, T, V) for decoders, hidden states (B, T, C) for encoders.
    The padding mask is passed only when there is padding, so unpadded batches take the
    unmasked fast path."""
    device = next(model.parameters()).device
    mask = None if bool(batch.mask.all()) else batch.mask.to(device)
    return model(batch.ids.to(device), attention_mask=mask)


def capture(
    model: nn.Module,
    texts: str | Sequence[str] | Batch,
    points: Sequence[str] = ("pattern",),
    *,
    layers: Sequence[int] | None = None,
    heads=None,
    max_length: int | None = None,
    grad: bool = False,
) -> tuple[Batch, Capture]:
    """Run `model` once on `texts` (or a ready Batch) and record `points` (see hooks.POINTS).
    Only the requested heads' patterns are rebuilt (from the fused backend's LSE)."""
    batch = texts if isinstance(texts, Batch) else encode(model, texts, max_length=max_length)
    cap = Capture(points, layers=layers, heads=heads, detach=not grad)
    with torch.set_grad_enabled(grad), attached(model, capture=cap):
        cap.output = forward(model, batch)
    return batch, cap
