"""Continuous batching under a token budget, over a paged KV cache (vLLM v1's scheduler, small).

Every step the scheduler fills a budget of `max_num_batched_tokens`:

1. Running requests, the poorest share first (fair.py; one share: oldest first). A decode
   (one token left to compute) takes 1 token; a request still prefilling takes a chunk of
   what the budget leaves after every running decode has its token (chunked prefill), so a
   long prompt never stalls the others' decoding, and a richer share's chunk leaves what the
   next waiting request's prompt needs.
2. Waiting requests in fair order (fewest running sequences of their client, then of their
   share; then priority, then arrival), while there are free sequence slots (`max_num_seqs`),
   budget and blocks: each is looked up in the prefix table first (full blocks of a prompt
   seen before are shared, not recomputed), then takes a chunk of its remaining tokens.

Blocks are reserved for the whole step up front. When a running request needs a block and
none is free, the richest share's newest running request is preempted: its blocks are freed
and it goes back to the queue with num_computed_tokens = 0, to be recomputed (prompt + what
it generated so far; its full blocks often survive in the prefix table); only a request a
richer share owes its place is admitted in that step. A share richer than the next waiting
request by two sequences gives up a slot (and blocks) the same way (fair.py). Recomputing the
same tokens gives the same K/V, so greedy outputs do not change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ..cache.paged import PagedKVCache
from .fair import Shares
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
        self.running: list[Request] = []  # in admission order (each step orders it by fair share)
        self.arrivals = 0  # requests added so far: each one's arrival number
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
        if request.arrival < 0:
            request.arrival, self.arrivals = self.arrivals, self.arrivals + 1
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
        shares = Shares(self.running)
        order = sorted(self.running, key=shares.key)  # poorest share first; one share: oldest first
        first = min(self.waiting, key=shares.key, default=None)  # the next to admit
        owed = first is not None and bool(order) and shares.richer(order[-1], first)
        if owed and len(self.running) >= self.max_num_seqs:
            victim = order.pop()  # a richer share's slot goes to the waiting one (fair.py)
            self._preempt(victim)
            shares.remove(victim)
            preempted.append(victim)
        # hold: what a richer share's prompt chunks leave for the next waiting request's prompt;
        # lend: what they may take in all, as little as that prompt when a richer share owes it a place
        hold, lend = 0, budget
        if first is not None and len(self.running) < self.max_num_seqs:
            hold = min(first.num_tokens - first.num_computed_tokens, budget // 2)
            lend = hold if owed else budget
        placed: dict[int, tuple[list, Chunk, int]] = {}  # id(request) -> (its list, its chunk, blocks reserved)
        short = False  # a running request found no free block: admit only what a richer share is owed
        decodes_left = sum(1 for r in order if r.num_tokens - r.num_computed_tokens == 1)
        for i, r in enumerate(order):
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
                if hold and shares.richer(r, first, by=1):
                    n = min(n - hold, lend)
                    lend -= max(n, 0)
            if n <= 0:
                continue
            need = cache.blocks_needed(r.seq_id, n)
            if draft and reserved + need > cache.num_free_blocks:  # a draft never preempts anyone
                draft, n = (), 1
                need = cache.blocks_needed(r.seq_id, n)
            while reserved + need > cache.num_free_blocks:
                # the richest share's newest, lowest priority; never one already scheduled
                victim = max((v for v in order[i:] if v.status is Status.RUNNING), key=shares.key)
                if victim is not r and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim)
                shares.remove(victim)
                preempted.append(victim)
                short = True
                if victim is r:
                    break
            if r.status is not Status.RUNNING:
                continue
            if left == 1:
                chunk, into = Chunk(r, r.num_computed_tokens, n, True, draft), decodes
            else:
                chunk, into = Chunk(r, r.num_computed_tokens, n, n == left), prefills
            into.append(chunk)
            placed[id(r)] = (into, chunk, need)
            budget -= n
            reserved += need
        if self.waiting:
            lent = (first, lend)
            budget, reserved = self._admit(budget, reserved, prefills, shares, placed, preempted, short, lent)
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

    def _admit(self, budget, reserved, chunks, shares: Shares, placed: dict, preempted: list, short: bool, lent):
        """Waiting requests in fair order (fair.py) while there are slots, budget and blocks; the
        first that does not fit stops admission (no overtaking by size). A request a richer share
        owes a slot takes the blocks it needs from that share's newest sequence, scheduled or not;
        after a preemption for blocks (short) only such a request is admitted. lent: (the first
        waiting request, the tokens shares richer than it may still take this step)."""
        first, lend = lent
        if budget <= 0 or len(self.running) >= self.max_num_seqs:
            return budget, reserved
        cache, out = self.cache, {id(r) for r in preempted}  # those preempted now wait for the next step
        queues: dict[tuple, list[Request]] = {}  # share -> its waiting requests, best last
        for r in sorted(self.waiting, key=lambda r: (r.group.priority, r.arrival), reverse=True):
            if id(r) not in out:
                queues.setdefault(r.group.share_key, []).append(r)
        admitted = set()
        while queues and budget > 0 and len(self.running) < self.max_num_seqs:
            r = min((q[-1] for q in queues.values()), key=shares.key)
            victim = max(self.running, key=shares.key, default=None)
            owed = victim is not None and shares.richer(victim, r)
            if short and not owed:
                break
            capped = first is not None and r is not first and shares.richer(r, first, by=1)
            if capped and lend <= 0:
                break
            hit = cache.add_sequence(r.seq_id, r.token_ids)  # shares full blocks found by prefix
            n = min(r.num_tokens - hit, budget, lend if capped else budget)
            need = cache.blocks_needed(r.seq_id, n)
            if reserved + need > cache.num_free_blocks:
                cache.free(r.seq_id)  # undo: the shared blocks go back
                if not owed:
                    break
                into, chunk, vneed = placed.pop(id(victim), (None, None, 0))
                if chunk is not None:  # it gives back this step's tokens and blocks too
                    into.remove(chunk)
                    budget, reserved = budget + chunk.num_tokens, reserved - vneed
                self._preempt(victim)
                shares.remove(victim)
                preempted.append(victim)
                continue
            q = queues[r.group.share_key]
            q.pop()
            if not q:
                del queues[r.group.share_key]
            admitted.add(id(r))
            if r.num_preemptions == 0:
                r.num_cached_tokens = hit
            self.prefix_queries += r.num_tokens
            self.prefix_hits += hit
            r.num_computed_tokens, r.status = hit, Status.RUNNING
            self.running.append(r)
            shares.add(r)
            chunk = Chunk(r, hit, n, hit + n == r.num_tokens)
            chunks.append(chunk)
            placed[id(r)] = (chunks, chunk, need)
            budget -= n
            reserved += need
            lend -= n if capped else 0
        if admitted:
            kept = [r for r in self.waiting if id(r) not in admitted]
            self.waiting.clear()
            self.waiting.extend(kept)
        return budget, reserved
