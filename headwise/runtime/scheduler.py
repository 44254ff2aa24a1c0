"""Continuous batching under a token budget, over a paged KV cache (vLLM v1's scheduler, small).

Every step the scheduler fills a budget of `max_num_batched_tokens`:

1. Running requests, oldest first. A decode (one token left to compute) takes 1 token;
   a request still prefilling takes a chunk of what the budget leaves after every
   running decode has its token (chunked prefill), so a long prompt never stalls the
   others' decoding.
2. If nothing was preempted, waiting requests in arrival order, while there are free
   sequence slots (`max_num_seqs`), budget and blocks: each is looked up in the prefix
   table first (full blocks of a prompt seen before are shared, not recomputed), then
   takes a chunk of its remaining tokens.

Blocks are reserved for the whole step up front. When a running request needs a block
and none is free, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue with num_computed_tokens = 0, to be recomputed
(prompt + what it generated so far; its full blocks often survive in the prefix table).
Recomputing the same tokens gives the same K/V, so greedy outputs do not change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ..cache.paged import PagedKVCache
from .request import Request, Status


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (requests or tokens); nothing was queued.
    `retry_after` is a hint in seconds (a server answers 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = float(retry_after)


class Chunk(NamedTuple):
    """Tokens [start, start + num_tokens) of `request` computed this step; `sample`: the chunk
    reaches the end of the request's tokens, so the next token is drawn from its last row.
    `draft`: a decode that also computes these predicted tokens after its one (num_tokens is
    1 + len(draft)); every row is sampled, in order, until one differs (predict.py)."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    draft: tuple = ()


@dataclass
class SchedulerOutput:
    chunks: list[Chunk]  # decodes first, then prefill chunks (the order of the pack)
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix table on admission
        self.prefix_hits = 0  # of those, found (not recomputed)
        # Predicted Outputs: decodes draft ahead where the cache can drop rejected K/V (not a hybrid
        # cache of windowed layers yet); max_model_len: set by the core, bounds a draft's positions
        self.drafts = hasattr(cache, "truncate")
        self.max_model_len = 0

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def model_changed(self) -> None:
        """The model computes differently now (weights edited, hooks, modules replaced): prefixes
        cached before must not be found again (blocks of running requests stay findable)."""
        self.cache.pool.clear_prefix_cache()

    def waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def finish(self, request: Request) -> None:
        """Drop a request wherever it is, freeing its blocks at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.cache.free(request.seq_id)
        elif request.status is Status.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = Status.FINISHED

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request.seq_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)  # first back in: it is older than what waits
        self.num_preemptions += 1

    # ------------------------------------------------------------------ a step
    def schedule(self) -> SchedulerOutput:
        cache, budget, reserved = self.cache, self.max_num_batched_tokens, 0
        decodes, prefills, preempted = [], [], []
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        for r in list(self.running):
            if r.status is not Status.RUNNING:  # preempted as a victim below
                continue
            left = r.num_tokens - r.num_computed_tokens
            draft = ()
            if left == 1:
                decodes_left -= 1
                if r.prediction is not None and self.drafts:
                    draft = r.prediction.draft(min(budget - decodes_left - 1, self._room(r)))
                n = 1 + len(draft)
            else:
                n = min(left, budget - decodes_left)
            if n <= 0:
                continue
            need = cache.blocks_needed(r.seq_id, n)
            if draft and reserved + need > cache.num_free_blocks:  # a draft never preempts anyone
                draft, n = (), 1
                need = cache.blocks_needed(r.seq_id, n)
            while reserved + need > cache.num_free_blocks:
                victim = self.running[-1]  # the newest; never one already scheduled
                if victim is not r and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if r.status is not Status.RUNNING:
                continue
            if left == 1:
                decodes.append(Chunk(r, r.num_computed_tokens, n, True, draft))
            else:
                prefills.append(Chunk(r, r.num_computed_tokens, n, n == left))
            budget -= n
            reserved += need
        if not preempted:
            budget, reserved = self._admit(budget, reserved, prefills)
        if not decodes and not prefills and self.waiting and not self.running and not preempted:
            r = self.waiting[0]  # would loop forever
            raise RuntimeError(
                f"cannot schedule request {r.group.request_id!r} ({r.num_tokens} tokens) with every block "
                f"free ({cache.num_free_blocks} of {cache.num_blocks}); this is a bug"
            )
        return SchedulerOutput(decodes + prefills, preempted)

    def _room(self, r: Request) -> int:
        """Draft tokens a decode of `r` may add: the output it may still take after this step's
        token, and the context left (max_model_len; the core sets it) for their K/V."""
        out = r.params.max_new_tokens - r.num_output_tokens - 1
        return min(out, self.max_model_len - r.num_tokens) if self.max_model_len else out

    def _admit(self, budget: int, reserved: int, chunks: list[Chunk]) -> tuple[int, int]:
        cache = self.cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            hit = cache.add_sequence(r.seq_id, r.token_ids)  # shares full blocks found by prefix
            n = min(r.num_tokens - hit, budget)
            need = cache.blocks_needed(r.seq_id, n)
            if reserved + need > cache.num_free_blocks:
                cache.free(r.seq_id)  # undo: the shared blocks go back
                break
            self.waiting.popleft()
            if r.num_preemptions == 0:
                r.num_cached_tokens = hit
            self.prefix_queries += r.num_tokens
            self.prefix_hits += hit
            r.num_computed_tokens, r.status = hit, Status.RUNNING
            self.running.append(r)
            chunks.append(Chunk(r, hit, n, hit + n == r.num_tokens))
            budget -= n
            reserved += need
        return budget, reserved
