"""Activation patching per head: which heads cause an answer, not only attend to it.

Attention weights are hints (the seed's warning); an intervention tests a cause.
Run a clean prompt and a corrupted one of the same token length, keep every head's
output z (B, H, T, D) from the clean run, then rerun the corrupted prompt with one
head's z replaced by the clean one at every position and measure how much of the
clean answer comes back (Vig et al. 2020 "causal mediation analysis"; Meng et al.
2022 ROME's causal tracing; Wang et al. 2022 IOI, arXiv:2211.00593):

    recovered = (metric_patched - metric_corrupted) / (metric_clean - metric_corrupted)

1: that head alone restores the clean answer; 0: it changes nothing. Metrics:
  - decoders: the logit difference answer - wrong at the last position;
  - encoders: cosine of the mean-pooled, normalized embedding to the clean one.
Patching z_h is patching the head's result z_h @ W_O[:, h].T (what it adds to the
residual stream; hooks.head_results): W_O is the same in both runs.

The sum_l H_l patched runs (270 for SmolLM2) are rows of a few batches: row b runs
the corrupted prompt with head (l, h) patched through hooks.attached (mask (B, H) = 0
at (b, h), replace = the clean z (H, T, D)); a decoder's rows ask for the last
position's logits only (Step.logits_indices) and reruns only the tokens after the
prompts' shared prefix (`shared_prefix`). Pairs and their checks: pairs.py; the
direct logit attribution beside it: dla.py; `study` runs both over a list of pairs.

Quantized weights (a GGUF as stored): their linears round activations to int8 per block,
so two routes that compute the same function (with and without the shared prefix) give
recovered fractions up to ~0.03 apart on SmolLM2 (median 0.01); with weights="fp32" they
agree to 3e-6 (benchmarks/patching.py runs both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from ..attention.step import PlainStep
from .capture import from_ids, is_causal
from .hooks import Capture, attached, heads_per_layer
from .pairs import Encoded, Pair, default_pairs, encode_pair

TOKEN_BUDGET = 4096  # tokens per patched batch (rows x tokens rerun): SmolLM2's 270 heads in one for the defaults
MIN_GAP = 1e-4  # |clean - corrupted| below this: the pair cannot show recovery


# ---------------------------------------------------------------------------- metrics


def last_logits(model: nn.Module, ids: Tensor, cache=None) -> Tensor:
    """ids (B, T) -> the last position's logits (B, V); the output layer runs on those rows only.
    With a cache holding a prefix, ids are the tokens after it."""
    B, T = ids.shape
    rows = torch.arange(B, device=ids.device) * T + (T - 1)
    step = PlainStep(B, T, ids.device, logits_indices=rows) if cache is None else cache.step(T, logits_indices=rows)
    return model(ids, step)


class _Measure:
    """The pair's metric on rows of ids (B, T): logit difference, or cosine to the clean embedding."""

    def __init__(self, model: nn.Module, pair: Encoded):
        self.model, self.pair, self.causal = model, pair, is_causal(model)
        self.clean_embedding: Tensor | None = None  # (C,), set from the clean run

    def embedding(self, ids: Tensor) -> Tensor:
        from .metrics import embeddings

        return embeddings(self.model, from_ids(ids.tolist()))  # (B, C), mean-pooled, normalized

    def __call__(self, ids: Tensor, cache=None) -> Tensor:  # (B,)
        if self.causal:
            lg = last_logits(self.model, ids, cache)
            return (lg[:, self.pair.answer] - lg[:, self.pair.wrong]).float()
        return (self.embedding(ids) @ self.clean_embedding).float()


@dataclass
class Patching:
    """One pair's patching: the metric clean / corrupted / with every head patched, and per
    layer (H_l,) the metric with each head patched alone and its recovered fraction."""

    metric: str
    clean: float
    corrupted: float
    all_heads: float  # every head of every layer patched at once
    patched: list[Tensor]
    recovered: list[Tensor]
    shared_prefix: int = 0  # leading tokens both prompts share (not rerun: patching there is a no-op)

    def to_json(self) -> dict:
        gap = self.clean - self.corrupted
        return {
            "metric": self.metric,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "all_heads": self.all_heads,
            "all_heads_recovered": (self.all_heads - self.corrupted) / gap,
            "shared_prefix": self.shared_prefix,
            "patched": [[round(float(x), 5) for x in t] for t in self.patched],
            "recovered": [[round(float(x), 5) for x in t] for t in self.recovered],
            "top": top_heads(self.recovered),
        }


def top_heads(per_layer: Sequence[Tensor], k: int = 5) -> list[dict]:
    """The k heads with the largest values: [{"layer", "head", "value"}]."""
    flat = [(float(v), l, h) for l, t in enumerate(per_layer) for h, v in enumerate(t)]
    flat.sort(key=lambda x: -x[0])
    return [{"layer": l, "head": h, "value": round(v, 4)} for v, l, h in flat[:k]]


def shared_prefix(model: nn.Module, enc: Encoded) -> int:
    """Leading tokens a decoder's patched runs can take from a cache instead of recomputing.

    Causally, positions before the first differing token see the same tokens in both
    prompts, so their z are the same and patching them changes nothing: the corrupted
    prefix's K/V is computed once and each patched row runs only the rest (IOI's 14-token
    prompt differs first at token 9: 5 tokens a row). 0 for encoders (every position sees
    every token) and for layers of unequal K/V shapes (uneven pruning: one cache shape)."""
    if not is_causal(model):
        return 0
    from .hooks import attention_layers

    if len({(a.num_kv_heads, a.head_dim) for a in attention_layers(model)}) != 1:
        return 0
    differ = (enc.clean != enc.corrupted).nonzero()
    return int(differ[0]) if len(differ) else enc.clean.numel()


def _prefix_cache(model: nn.Module, prefix: Tensor, B: int, T: int):
    """A ContiguousKVCache of B rows, each holding `prefix`'s (1, p) K/V, room for T tokens."""
    from ..cache import ContiguousKVCache
    from .hooks import attention_layers

    cap = Capture(("k", "v"))
    with attached(model, capture=cap):
        model(prefix)
    a = attention_layers(model)[0]
    k0 = cap.k[0]
    cache = ContiguousKVCache(len(cap.k), B, a.num_kv_heads, T, a.head_dim, dtype=k0.dtype, device=k0.device)
    for i in range(len(cap.k)):
        cache.layer(i).update(cap.k[i].expand(B, -1, -1, -1), cap.v[i].expand(B, -1, -1, -1))
    return cache


@torch.no_grad()
def patch_heads(
    model: nn.Module, pair: Pair | Encoded, *, token_budget: int = TOKEN_BUDGET, use_prefix: bool = True, progress=None
) -> Patching:
    """Patch every head of `model` from the clean prompt into the corrupted one, one at a time
    (module docstring). use_prefix: decoders rerun only the tokens after the prompts' shared
    prefix (`shared_prefix`; False reruns every token, the same numbers up to fp32 rounding).
    progress: a tqdm-like bar, advanced once per patched head."""
    enc = pair if isinstance(pair, Encoded) else encode_pair(model, pair)
    device = next(model.parameters()).device
    clean, corrupted = enc.clean[None].to(device), enc.corrupted[None].to(device)  # (1, T)
    T = clean.shape[1]
    p = shared_prefix(model, enc) if use_prefix else 0
    if p == T:
        raise ValueError("the clean and corrupted prompts are the same tokens; corrupt a token the answer depends on")
    measure = _Measure(model, enc)
    cap = Capture(("z",))
    with attached(model, capture=cap):
        if measure.causal:
            clean_value = float(measure(clean)[0])
        else:
            measure.clean_embedding = measure.embedding(clean)[0]
            clean_value = 1.0  # the clean embedding against itself
    z = [cap.z[l][0] for l in range(len(cap.z))]  # per layer (H, T, D)
    corrupted_value = float(measure(corrupted)[0])
    hpl = heads_per_layer(model)
    with attached(model, mask=[torch.zeros(H, device=device) for H in hpl], replace=z):
        all_heads = float(measure(corrupted)[0])
    gap = clean_value - corrupted_value
    if not abs(gap) > MIN_GAP:
        raise ValueError(
            f"the clean and corrupted prompts give the same metric ({clean_value:.6g} vs {corrupted_value:.6g}); "
            f"nothing to recover: corrupt a token the answer depends on"
        )
    heads = [(l, h) for l, H in enumerate(hpl) for h in range(H)]
    rest = corrupted[:, p:]  # (1, T - p): what each patched row runs
    z_rest = [t[:, p:] for t in z]  # (H, T - p, D)
    chunks = max(1, math.ceil(len(heads) * rest.shape[1] / token_budget))
    rows = math.ceil(len(heads) / chunks)  # even chunks: 270 heads in 2 batches of 135, not 256 + 14
    values = torch.empty(len(heads))
    for start in range(0, len(heads), rows):
        part = heads[start : start + rows]
        B = len(part)
        masks: list[Tensor | None] = [None] * len(hpl)
        for b, (l, h) in enumerate(part):
            if masks[l] is None:
                masks[l] = torch.ones(B, hpl[l], device=device)
            masks[l][b, h] = 0.0
        replace = [z_rest[l] if masks[l] is not None else None for l in range(len(hpl))]
        cache = _prefix_cache(model, corrupted[:, :p], B, T) if p else None
        with attached(model, mask=masks, replace=replace):
            values[start : start + B] = measure(rest.expand(B, -1).contiguous(), cache).cpu()
        if progress is not None:
            progress.update(B)
    patched, recovered, i = [], [], 0
    for H in hpl:
        patched.append(values[i : i + H].clone())
        recovered.append((values[i : i + H] - corrupted_value) / gap)
        i += H
    name = "logit_diff" if measure.causal else "cosine"
    return Patching(name, clean_value, corrupted_value, all_heads, patched, recovered, p)


def study(model: nn.Module, pairs: Sequence[Pair] | None = None, *, progress=None) -> dict:
    """Patching (and for decoders direct logit attribution) over `pairs`, JSON-able, with the
    mean recovered fraction per head over the pairs. pairs=None takes the defaults and skips,
    with the reason, those this model's tokenizer cannot line up; given pairs must all work.
    progress: a tqdm-like bar whose total this sets (pairs x heads)."""
    from .dla import pair_attribution

    strict = pairs is not None
    pairs = list(pairs) if strict else default_pairs(model)
    hpl = heads_per_layer(model)
    causal = is_causal(model)
    ready, skipped = [], []
    for n, pair in enumerate(pairs, 1):
        try:
            ready.append((pair, encode_pair(model, pair)))
        except ValueError as e:
            if strict:
                raise ValueError(f"pair {n}: {e}") from None
            skipped.append({"pair": n, "clean": str(pair.clean), "reason": str(e)})
    if progress is not None:
        progress.total = len(ready) * sum(hpl)
        progress.refresh()
    out = []
    for n, (pair, enc) in enumerate(ready, 1):
        try:
            patching = patch_heads(model, enc, progress=progress)
        except ValueError as e:  # no gap between the prompts on this model
            if strict:
                raise ValueError(f"pair {n}: {e}") from None
            skipped.append({"pair": n, "clean": str(pair.clean), "reason": str(e)})
            continue
        row = {
            "clean": str(pair.clean),
            "corrupted": str(pair.corrupted),
            "answer": pair.answer,
            "wrong": pair.wrong,
            "tokens": enc.tokens,
            "corrupted_tokens": enc.corrupted_tokens,
            "patching": patching.to_json(),
        }
        if causal:
            dla = pair_attribution(model, enc.clean, enc.answer, enc.wrong)
            row["dla"] = {k: v.to_json() for k, v in dla.items()}
        out.append((patching, row))
    result = {"metric": "logit_diff" if causal else "cosine", "pairs": [row for _, row in out], "skipped": skipped}
    if out:
        mean = [torch.stack([p.recovered[l] for p, _ in out]).mean(0) for l in range(len(hpl))]
        result["mean_recovered"] = [[round(float(x), 5) for x in t] for t in mean]
        result["top"] = top_heads(mean)
        if causal:
            heads = [torch.tensor([r["dla"]["diff"]["heads"][l] for _, r in out]).mean(0) for l in range(len(hpl))]
            result["mean_dla"] = [[round(float(x), 5) for x in t] for t in heads]
            result["dla_top"] = top_heads(heads)
    if not causal:
        result["dla"] = (
            "not for encoders: no unembedding, and a LayerNorm after every block makes the output "
            "non-additive in the heads"
        )
    return result
