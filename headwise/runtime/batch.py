"""generate()'s half of the one loop: a fixed batch over one contiguous cache.

    core = Core(model, StaticBatch(), ContiguousRunner(model, B, max_len), max_model_len=...)

`StaticBatch` schedules every prompt's whole prefill in the first step and then one token per
unfinished sequence per step; `ContiguousRunner` runs them on a `ContiguousKVCache` sized for
the batch (prompts right-padded in one forward that asks for each prompt's last row only; then
(B, 1) decode steps, which the fused executor takes whole). A sequence that finished early
still rides along in the cache's decode steps (its row is not sampled): at batch 1 and for
the short batches generate() runs, one wasted row costs less than the paged pool's
bookkeeping per step. compile=True runs each decode step as one torch.compile graph over a
static cache (compiled.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import cache as caches
from .config import kv_dtype_for
from .request import Request, Status
from .windows import model_windows
from .scheduler import Chunk, SchedulerOutput


class StaticBatch:
    """The scheduler of a fixed batch: requests added before the first step, none after."""

    def __init__(self):
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # always empty: every request runs from the first step

    def add(self, request: Request) -> None:
        if request.params.prediction is not None:
            raise ValueError(
                "prediction (Predicted Outputs) runs in the Engine, whose paged cache drops the K/V of rejected "
                "drafts; generate() has no use for it: use headwise.Engine, or leave prediction unset"
            )
        request.status = Status.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        return bool(self.running)

    def model_changed(self) -> None:
        pass  # no K/V outlives the batch

    def finish(self, request: Request) -> None:
        if request.status is Status.RUNNING:
            self.running.remove(request)
        request.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput(
            [Chunk(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, True) for r in self.running], []
        )


@dataclass
class Batch:
    chunks: list[Chunk]
    input_ids: Tensor  # (B, T) long: every row of the cache, right-padded
    step: object  # the cache's Step
    rows: list[int]  # cache row of each chunk

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class ContiguousRunner:
    """B rows of one ContiguousKVCache of max_len slots; request i added to the core is row i."""

    def __init__(self, model, batch_size: int, max_len: int, *, kv_dtype: str | None = None, compile: bool = False):
        """kv_dtype None: decided by runtime/config.py's kv_dtype_for (16-bit for a quantized model,
        the model's dtype otherwise; with compile=True always the model's)."""
        if compile and kv_dtype not in (None, "float32", "fp32"):
            raise ValueError(
                f"kv_dtype={kv_dtype!r} does not combine with compile=True (its static cache holds the model's dtype)"
            )
        kv_dtype = None if compile else kv_dtype_for(kv_dtype, model)
        cfg, param = model.config, next(model.parameters())
        self.model, self.device, self.B = model, param.device, batch_size
        self.compiled = None
        if compile:
            from .compiled import compiled_decode_step, static_cache, static_cache_size

            self.compiled = compiled_decode_step(model)
            slots = static_cache_size(max_len, cfg.max_positions)
            self.cache = static_cache(model, batch_size, slots, dtype=param.dtype, device=self.device)
        else:
            self.cache = caches.ContiguousKVCache(
                cfg.num_layers,
                batch_size,
                cfg.num_kv_heads,
                max_len,
                cfg.head_dim,
                dtype=param.dtype,
                device=self.device,
                kv_dtype=kv_dtype,
                windows=model_windows(cfg),  # windowed layers keep a ring of their last W tokens
            )
        self.row: dict[tuple, int] = {}  # seq_id -> cache row, in the order of the first step's chunks
        self.last = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)  # (B, 1) each row's newest id

    def prepare(self, chunks: list[Chunk]) -> Batch:
        if not self.row:  # the first step: every prompt, right-padded to the longest
            if len(chunks) != self.B or any(c.start for c in chunks):
                raise RuntimeError(f"the first step of a batch of {self.B} must prefill all of it")
            self.row = {c.request.seq_id: b for b, c in enumerate(chunks)}
            lengths = [c.num_tokens for c in chunks]
            T0 = max(lengths)
            ids = torch.zeros(self.B, T0, dtype=torch.long, device=self.device)  # (B, T0)
            for b, c in enumerate(chunks):
                ids[b, : c.num_tokens] = torch.tensor(c.request.token_ids[: c.num_tokens], device=self.device)
            lens = torch.tensor(lengths, device=self.device)  # (B,)
            last = torch.arange(self.B, device=self.device) * T0 + lens - 1  # each prompt's last real token, b*T0 + t
            step = self.cache.step(T0, num_new=None if min(lengths) == T0 else lens, logits_indices=last)
            return Batch(chunks, ids, step, list(range(self.B)))
        rows = [self.row[c.request.seq_id] for c in chunks]
        for b, c in zip(rows, chunks):
            self.last[b, 0] = c.request.token_ids[c.start]
        if self.compiled is not None:
            self.cache.book(1)  # host bookkeeping, outside the graph
            return Batch(chunks, self.last, None, rows)
        return Batch(chunks, self.last, self.cache.step(1), rows)

    def run(self, batch: Batch) -> Tensor:
        """-> logits (R, V) of the chunks' rows, in chunk order."""
        with torch.inference_mode():
            if batch.step is None:
                logits = self.compiled(batch.input_ids, self.cache)  # (B, V)
            else:
                logits = self.model(batch.input_ids, batch.step)  # (B, T, V) or (B, V)
                if logits.dim() == 3:
                    logits = logits[:, -1]
        return logits if len(batch.rows) == self.B else logits[batch.rows]

    def commit(self, batch: Batch) -> None:
        pass
