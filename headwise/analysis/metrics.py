"""Quality metrics for ablation and pruning, and the per-example losses importance needs.

Decoders: next-token loss and perplexity on held-out text (the model's own task).
Encoders (sentence embeddings, e.g. all-MiniLM-L6-v2): agreement with the full
model's embeddings on a sentence set: mean cosine between each sentence's ablated
and full embedding, and nearest-neighbour retrieval agreement (the share of
sentences whose nearest other sentence is the same one as with the full model).

Each metric gives a "quality drop" in [0, inf): relative perplexity increase
(ppl / ppl_full - 1) for decoders, 1 - mean cosine for encoders; the 1% / 5%
thresholds of the ablation curves are on that number.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .capture import Batch, encode, forward, is_causal
from .hooks import attached

RETRIEVAL_TEMPERATURE = 0.05  # sentence-transformers' MultipleNegativesRankingLoss scale 20


def lm_token_losses(model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
    """Per-row summed next-token NLL (B,) and number of predicted tokens (B,)."""
    logits = forward(model, batch)  # (B, T, V)
    target = batch.ids[:, 1:].to(logits.device)
    keep = (batch.mask[:, 1:] * batch.mask[:, :-1]).bool().to(logits.device)
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), target, reduction="none")  # (B, T-1)
    return (nll * keep).sum(1), keep.sum(1)


def embeddings(model: nn.Module, batch: Batch) -> Tensor:
    """Mean-pooled, L2-normalized sentence embeddings (B, C), as headwise.embed."""
    hidden = forward(model, batch)
    hidden = hidden.float() if hidden.dtype in (torch.float16, torch.bfloat16) else hidden
    m = batch.mask.to(hidden.device)[..., None].to(hidden.dtype)
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)


def retrieval_loss(emb: Tensor, target: Tensor) -> Tensor:
    """Per-row loss (B,) of finding one's own full-model embedding among the batch's:
    cross-entropy of emb_i . target_j / tau over j, label i. Unlike a distance to the
    target it has a non-zero gradient at the unablated model, which Michel et al.'s
    first-order importance needs."""
    logits = emb @ target.T / RETRIEVAL_TEMPERATURE
    return F.cross_entropy(logits, torch.arange(len(emb), device=emb.device), reduction="none")


class Metric:
    """Quality of `model` on a fixed held-out set, under optional head masks / replacements."""

    name: str
    unit: str

    def evaluate(self, model: nn.Module, mask=None, replace=None) -> dict:
        raise NotImplementedError

    def drop(self, result: dict) -> float:
        raise NotImplementedError

    def extra_drops(self, result: dict) -> dict[str, float]:
        """Other views of the same drop, reported beside the main one."""
        return {}


class LMMetric(Metric):
    name, unit = "perplexity", "relative perplexity increase"

    def __init__(self, batches: Sequence[Batch]):
        self.batches = list(batches)
        self.baseline: dict | None = None

    @torch.no_grad()
    def evaluate(self, model, mask=None, replace=None) -> dict:
        total, count = 0.0, 0
        with attached(model, mask=mask, replace=replace):
            for b in self.batches:
                s, n = lm_token_losses(model, b)
                total, count = total + float(s.sum()), count + int(n.sum())
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": float(torch.tensor(loss).exp()), "tokens": count}

    def drop(self, result: dict) -> float:
        return result["perplexity"] / self.baseline["perplexity"] - 1.0

    def extra_drops(self, result: dict) -> dict[str, float]:
        return {"drop_loss": result["loss"] / self.baseline["loss"] - 1.0}


class EmbeddingMetric(Metric):
    name, unit = "embedding agreement", "1 - mean cosine to the full model"

    def __init__(self, model: nn.Module, batches: Sequence[Batch]):
        self.batches = list(batches)
        with torch.no_grad():
            self.full = torch.cat([embeddings(model, b) for b in self.batches])  # (N, C)
        self.full_nn = _nearest(self.full)
        self.baseline = {"cosine": 1.0, "nn_agreement": 1.0}

    @torch.no_grad()
    def evaluate(self, model, mask=None, replace=None) -> dict:
        with attached(model, mask=mask, replace=replace):
            emb = torch.cat([embeddings(model, b) for b in self.batches])
        cos = (emb * self.full).sum(-1)
        return {
            "cosine": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "nn_agreement": float((_nearest(emb) == self.full_nn).float().mean()),
            "sentences": len(emb),
        }

    def drop(self, result: dict) -> float:
        return 1.0 - result["cosine"]

    def extra_drops(self, result: dict) -> dict[str, float]:
        return {"drop_retrieval": 1.0 - result["nn_agreement"]}


def _nearest(emb: Tensor) -> Tensor:
    sim = emb @ emb.T
    sim.fill_diagonal_(-float("inf"))
    return sim.argmax(-1)


def example_losses(model: nn.Module, batch: Batch, target: Tensor | None = None) -> Tensor:
    """(B,) per-example losses for importance: mean next-token NLL for decoders; for encoders
    the retrieval loss against `target` (the full model's embeddings of this batch)."""
    if is_causal(model):
        s, n = lm_token_losses(model, batch)
        return s / n.clamp_min(1)
    if target is None:
        raise ValueError("encoder importance needs target= the full model's embeddings of the batch")
    return retrieval_loss(embeddings(model, batch), target)


def text_batches(
    model: nn.Module, texts: Sequence[str], *, batch_size: int, max_length: int | None = None, sort: bool = True
) -> list[Batch]:
    """Batches of texts, sorted by length (so little padding) when `sort`."""
    texts = sorted(texts, key=len) if sort else list(texts)
    return [encode(model, texts[i : i + batch_size], max_length=max_length) for i in range(0, len(texts), batch_size)]


def token_batches(
    model: nn.Module, paragraphs: Sequence[str], *, seq_len: int, rows: int, batch_size: int
) -> list[Batch]:
    """The paragraphs' tokens as one stream cut into `rows` windows of seq_len (decoder LM eval)."""
    from .capture import from_ids, token_texts

    tok = model.tokenizer
    stream: list[int] = []
    for p in paragraphs:
        stream += tok.encode(p + "\n\n", add_special_tokens=False)
        if len(stream) >= seq_len * rows:
            break
    if len(stream) < seq_len * rows:
        raise ValueError(
            f"the text has {len(stream)} tokens; {rows} rows of {seq_len} need {seq_len * rows} "
            f"(use a larger corpus or fewer rows)"
        )
    windows = [stream[i * seq_len : (i + 1) * seq_len] for i in range(rows)]
    special = tok.special_token_ids
    return [
        from_ids(
            windows[i : i + batch_size],
            special=special,
            tokens=[token_texts(tok, w) for w in windows[i : i + batch_size]],
        )
        for i in range(0, rows, batch_size)
    ]
