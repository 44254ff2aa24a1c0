"""Per-request sampling for a step: one row of logits per request that gets a token.

Rows of greedy requests without a repetition penalty share one argmax; every other row
goes through `headwise.generation.sample` with its own parameters and its own
torch.Generator (seeded requests draw the same tokens whatever else shares the step).
Logprobs are taken on the unmodified distribution, as `generate()` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import argmax_rows
from ..generation.sampling import TokenLogprobs, sample, token_logprobs
from .request import Request


def sample_rows(logits: Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits (R, V) fp32, row i for requests[i] -> (token id per row, logprobs per row or None)."""
    R = len(requests)
    tokens: list[int | None] = [None] * R
    plain = [i for i, r in enumerate(requests) if r.params.greedy and r.params.repetition_penalty == 1.0]
    if plain:
        picked = argmax_rows(logits[plain] if len(plain) < R else logits).tolist()
        for i, t in zip(plain, picked):
            tokens[i] = t
    for i, r in enumerate(requests):
        if tokens[i] is None:
            seen = r.seen[None] if r.seen is not None else None
            tokens[i] = int(sample(logits[i : i + 1], r.params, seen=seen, generator=r.generator))
    logprobs: list[TokenLogprobs | None] = [None] * R
    for i, r in enumerate(requests):
        if r.params.logprobs is not None:
            logprobs[i] = token_logprobs(logits[i : i + 1], torch.tensor([tokens[i]]), r.params.logprobs)[0]
    return tokens, logprobs
