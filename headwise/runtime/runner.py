"""`PagedRunner`: a scheduled batch -> input_ids, a packed paged step, logits of the sampled rows.

The step's tokens are packed on one axis, input_ids (1, N), N = the sum of the chunks'
lengths, sequence by sequence with no padding, and run through the model in ONE forward
over a packed paged step (`PagedKVCache.packed`): every projection and MLP matmul serves
all requests at once. `logits_indices` names the rows that get a token (the last row of
each chunk that reaches its request's end), so the model runs its output layer (~20% of
SmolLM2's weights per row) on those R rows only and returns logits (R, V).

    batch = runner.prepare(chunks)      # under the core's lock: reserves slots in the pool
    logits = runner.run(batch)          # (R, V) fp32; outside the lock
    runner.commit(batch)                # under the lock again: the pool's deferred bookkeeping

Every runner (this one, and batch.py's `ContiguousRunner` for generate()) has these three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.paged import PagedKVCache
from .scheduler import Chunk


@dataclass
class Batch:
    """One step's model input. rows: the pack rows whose logits come back, in chunk order: the
    last row of each sampled chunk, every row of a chunk with a draft."""

    chunks: list[Chunk]
    input_ids: Tensor  # (1, N) long
    step: object  # PackedStep: positions, block tables, logits_indices
    rows: list[int]  # flat rows of the pack (0 * N + t), R of them

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


class PagedRunner:
    def __init__(self, model, cache: PagedKVCache):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device

    def prepare(self, chunks: list[Chunk]) -> Batch:
        """Reserve the chunks' slots in the cache and build the step (call under the engine's lock)."""
        news = [
            c.request.token_ids[c.start : c.start + c.num_tokens]
            if not c.draft
            else [c.request.token_ids[c.start], *c.draft]
            for c in chunks
        ]
        rows, off = [], 0
        for c in chunks:
            off += c.num_tokens
            if c.draft:  # a decode with predicted tokens: every row is a candidate (core.py verifies)
                rows.extend(range(off - c.num_tokens, off))
            elif c.sample:
                rows.append(off - 1)
        input_ids = torch.tensor([[t for new in news for t in new]], dtype=torch.long, device=self.device)  # (1, N)
        seq_ids, counts = [c.request.seq_id for c in chunks], [c.num_tokens for c in chunks]
        # A step of prefill chunks only samples nothing, but the model must run for the K/V it
        # writes: ask for one row (the last) rather than all N, and drop it. (A list: the model
        # checks it in Python, where a tensor would cost reductions and syncs every step.)
        # decodes with drafts (and plain decodes beside them) run as rows of the decode stack
        rows_ok = any(c.draft for c in chunks) and all(c.draft or c.num_tokens == 1 for c in chunks)
        step = self.cache.packed(
            seq_ids, counts, news, defer_prefix=True, logits_indices=rows or [off - 1], as_rows=rows_ok
        )
        return Batch(chunks, input_ids, step, rows)

    def run(self, batch: Batch) -> Tensor | None:
        """-> logits (R, V) fp32 of the batch's sampled rows, in chunk order; None when R = 0
        (every chunk is a prefill that does not reach its request's end yet)."""
        with torch.inference_mode():
            logits = self.model(batch.input_ids, batch.step)  # (R, V)
        return logits if batch.rows else None

    def commit(self, batch: Batch) -> None:
        batch.step.commit()
