"""`Engine`: a model, a paged KV cache and a scheduler, stepped by one background thread.

    engine = headwise.Engine(headwise.load("smollm2-135m-instruct"))
    outs = engine.generate(["Hi!", "Tell me a joke"], headwise.SamplingParams(temperature=0))
    async for piece in engine.stream(prompt, params): ...      # many streams share each step

Each step: the scheduler picks tokens under a budget (scheduler.py); they are packed on
one axis, input_ids (1, N), and run through the model in ONE forward over a packed paged
step (cache/packed.py), so every projection and MLP matmul serves all requests at once,
with no padding to the longest; only the rows that get a token go through the output
layer; each of those is sampled with its own parameters (sampler.py).

Threads: scheduler and cache bookkeeping happen under one lock; the forward runs outside
it. So `add_request` and `abort` never wait for a forward, and an abort frees the
request's blocks at once, even while a step that includes it is running: that step's
writes into the freed blocks are dropped with its result, and no block is handed out
again before the step ends, since only the stepping thread allocates.
"""
from __future__ import annotations

import asyncio
import collections
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Callable

import torch

from ..cache.paged import PagedKVCache
from ..cache.quantized import kv_bytes_per_token
from ..generation.generate import _normalize_prompts, _Sequence, _stop_ids, _stream_decoder
from ..generation.sampling import SamplingParams
from .request import Request, RequestGroup, RequestOutput, Status, StreamPiece
from .sampler import sample_rows
from .scheduler import QueueFull, Scheduler

# The KV pool when neither num_blocks nor memory_budget_bytes is given: 1 GiB holds ~23k
# tokens of SmolLM2-135M in fp32 (46 KiB per token), 64 sequences of ~360 tokens; at most
# a quarter of the memory available when the engine is built.
DEFAULT_KV_BUDGET = 1 << 30
SAMPLES = 4096              # latency samples kept (ttft, inter-token): the most recent ones
KEEP_OUTPUTS = 1024         # finished outputs kept for `result()` (streams keep none)


class Samples(list):
    """Recent latency samples in seconds (a plain list), shown as percentiles: printing
    4,096 floats says nothing. `summary()` -> {"count", "p50", "p90", "p99"} (None when empty)."""

    def summary(self) -> dict:
        xs = sorted(self)
        if not xs:
            return {"count": 0, "p50": None, "p90": None, "p99": None}

        def pct(q):                                 # nearest rank
            return xs[min(len(xs) - 1, max(0, -(-len(xs) * q // 100) - 1))]
        return {"count": len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}

    def __repr__(self) -> str:
        d = self.summary()
        if not d["count"]:
            return "Samples(count=0)"
        return f"Samples(count={d['count']}, " + ", ".join(f"{k}={d[k] * 1e3:.1f}ms" for k in ("p50", "p90", "p99")) + ")"


@dataclass
class EngineStats:
    running: int                    # sequences holding KV blocks (a request with n > 1 counts n)
    waiting: int                    # sequences queued, preempted ones included
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_block_size: int
    preemptions: int
    prefix_cache_queries: int       # prompt tokens looked up in the prefix table on admission
    prefix_cache_hits: int          # of those, found: their K/V was shared, not recomputed
    prompt_tokens: int              # accepted requests' prompt tokens
    prefill_tokens: int             # prompt (and recomputed) tokens run through the model: an aborted
                                    # request that never got scheduled adds none
    output_tokens: int              # generated tokens
    requests_finished: int          # stop or length
    requests_aborted: int
    steps: int
    step_seconds: dict[str, float]  # time spent per part of all steps: schedule (+ building the packed
                                    # step), forward, output (sampling, detokenizing, bookkeeping)
    ttft_s: Samples                 # recent time-to-first-token samples, seconds (repr: percentiles)
    itl_s: Samples                  # recent inter-token latency samples, seconds
    decode_tokens_per_second: float | None   # tokens after each request's first / the time they took,
                                             # over finished/aborted requests; None before any had 2 tokens

    def as_dict(self) -> dict:
        """Plain numbers: the latency samples as {"count", "p50", "p90", "p99"}."""
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s")}
        return {**d, "ttft_s": self.ttft_s.summary(), "itl_s": self.itl_s.summary()}


class Engine:
    """Continuous batching over a paged KV cache for one decoder model.

    Args:
        max_num_seqs: sequences running at once (each holds KV blocks).
        num_blocks: KV pool size in blocks; None sizes it from memory_budget_bytes.
        block_size: tokens per KV block.
        max_num_batched_tokens: tokens computed per step (decodes + prefill chunks); >= max_num_seqs.
        kv_dtype: None (the model's dtype) or "int8".
        max_waiting_requests, max_waiting_tokens: the waiting queue's bounds (requests, prompt
            tokens); add_request/stream beyond them raise QueueFull. max_waiting_tokens None =
            4x the tokens the KV pool holds.
        memory_budget_bytes: bytes for the KV pool when num_blocks is None (default 1 GiB,
            at most a quarter of available memory).
    """

    def __init__(self, model, *, max_num_seqs: int = 64, num_blocks: int | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 512, kv_dtype=None, max_waiting_requests: int = 256,
                 max_waiting_tokens: int | None = None, memory_budget_bytes: int | None = None):
        cfg = getattr(model, "config", None)
        if cfg is None or not getattr(cfg, "causal", False) or not getattr(cfg, "lm_head", False):
            kind = getattr(cfg, "arch", type(model).__name__)
            raise ValueError(f"the engine serves decoder language models (llama, gpt2 families); got {kind!r}, "
                             f"which has no causal LM head (use headwise.embed for encoders)")
        for name, val in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                          ("max_num_batched_tokens", max_num_batched_tokens),
                          ("max_waiting_requests", max_waiting_requests)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} < max_num_seqs={max_num_seqs}: "
                             f"every running sequence needs a token of the step budget to decode")
        self.model, self.tokenizer = model, getattr(model, "tokenizer", None)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if num_blocks is None:
            num_blocks = self._blocks_for_budget(cfg, memory_budget_bytes, block_size, kv_dtype, max_num_seqs)
        elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
        # Sequences start at fixed-stride regions of the pool while there is room (decodes of all of
        # them read as one strided view), else mid-way into the largest free stretch (each stays one
        # consecutive run, read in place); see cache/packed.py.
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                                  dtype=self.dtype, device=self.device, kv_dtype=kv_dtype, spread=True,
                                  region_blocks=max(1, num_blocks // max_num_seqs))
        self.block_size, self.max_num_seqs, self.max_num_batched_tokens = block_size, max_num_seqs, max_num_batched_tokens
        self.max_model_len: int = min(cfg.max_positions, num_blocks * block_size)
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = 4 * num_blocks * block_size if max_waiting_tokens is None else max_waiting_tokens
        if isinstance(self.max_waiting_tokens, bool) or not isinstance(self.max_waiting_tokens, int) \
                or self.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be a positive int or None, got {max_waiting_tokens!r}")
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self._lock = threading.RLock()              # scheduler, cache bookkeeping, requests, counters
        self._wake = threading.Condition(self._lock)
        self._step_mutex = threading.Lock()         # one step at a time (thread or generate())
        self._groups: dict[str, RequestGroup] = {}  # unfinished requests
        self._outputs: collections.OrderedDict[str, RequestOutput] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._ttft = collections.deque(maxlen=SAMPLES)
        self._itl = collections.deque(maxlen=SAMPLES)
        self._counts = collections.Counter()        # prompt_tokens, prefill_tokens, output_tokens, finished,
                                                    # aborted, steps, decode_tokens (after each first token)
        self._decode_seconds = 0.0                  # first token to last, summed over finished requests
        self._rate = 0.0                            # tokens computed per second, smoothed (for retry_after)
        self._seconds = {"schedule": 0.0, "forward": 0.0, "output": 0.0}

    def _blocks_for_budget(self, cfg, budget, block_size, kv_dtype, max_num_seqs) -> int:
        per_block = kv_bytes_per_token(cfg, "int8" if kv_dtype is not None else self.dtype) * block_size
        if budget is None:
            try:
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                available = 4 * DEFAULT_KV_BUDGET
            budget = min(DEFAULT_KV_BUDGET, available // 4)
            wanted = max_num_seqs * -(-cfg.max_positions // block_size)     # no use for more than this
            return max(1, min(wanted, budget // per_block))
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < per_block:
            raise ValueError(f"memory_budget_bytes={budget!r} does not hold one KV block ({per_block} bytes: "
                             f"{block_size} tokens x {per_block // block_size} bytes per token)")
        return budget // per_block

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, sampling: SamplingParams | None = None, *, request_id: str | None = None,
                    on_piece: Callable[[StreamPiece], None] | None = None) -> str:
        """Queue one prompt (text, token ids or chat messages); returns its request id.

        on_piece(piece) is called from the engine thread with each `StreamPiece` (or with an
        exception if the engine fails). Without it, `result(request_id)` waits for the output.
        Raises QueueFull (nothing queued) or ValueError (bad prompt or sampling). The request
        runs once the engine is started (`start()`), or within `step()` / `generate()`.
        """
        return self._add(self._one_prompt(prompt), sampling, request_id, on_piece, limits=True).request_id

    def _one_prompt(self, prompt) -> list[int]:
        ids, single = _normalize_prompts(self.model, prompt)
        if not single:
            raise ValueError(f"one prompt per request; got a list of {len(ids)} prompts (use generate() for a batch)")
        return ids[0]

    def _add(self, ids: list[int], sampling, request_id, sink, *, limits: bool) -> RequestGroup:
        params = sampling if sampling is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling must be a headwise.SamplingParams, got {type(params).__name__}")
        V = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are out of range for this model's vocabulary of {V}")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} that "
                             f"exceeds max_model_len={self.max_model_len} (the model's context of "
                             f"{self.model.config.max_positions} tokens, or the KV pool's {self.cache.num_blocks} "
                             f"blocks x {self.block_size} tokens)")
        if params.n * len(ids) > self.max_waiting_tokens:
            raise ValueError(f"the prompt takes {params.n} x {len(ids)} tokens, more than the waiting queue ever "
                             f"holds (max_waiting_tokens={self.max_waiting_tokens})")
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        group = RequestGroup(rid, ids, params, sink)
        stop_ids = _stop_ids(self.tokenizer, params)
        for i in range(params.n):
            gen = None
            if params.seed is not None:       # as generate(): completion i draws from seed + i
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seen = None
            if params.repetition_penalty != 1.0:
                seen = torch.zeros(V, dtype=torch.bool, device=self.device)
                seen[torch.tensor(ids, device=self.device)] = True
            out = _Sequence(ids, params, stop_ids, _stream_decoder(self.tokenizer))
            group.children.append(Request(group, i, out, gen, seen, token_ids=list(ids)))
        with self._lock:
            self._check_alive()
            if rid in self._groups:
                raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
            if limits:
                self._check_queue(group)
            self._groups[rid] = group
            for c in group.children:
                self.scheduler.add(c)
            self._counts["prompt_tokens"] += len(ids)
            self._wake.notify_all()
        return group

    def _check_queue(self, group: RequestGroup) -> None:
        waiting = {r.group.request_id for r in self.scheduler.waiting}
        tokens = self.scheduler.waiting_tokens()
        new = group.params.n * len(group.prompt_token_ids)
        why = None
        if len(waiting) + 1 > self.max_waiting_requests:
            why = f"{len(waiting)} requests are waiting (max_waiting_requests={self.max_waiting_requests})"
        elif tokens + new > self.max_waiting_tokens:
            why = (f"{tokens} prompt tokens are waiting and this request adds {new} "
                   f"(max_waiting_tokens={self.max_waiting_tokens})")
        if why:
            retry = min(60.0, max(1.0, tokens / self._rate)) if self._rate > 0 else 1.0
            raise QueueFull(f"the engine's queue is full: {why}; retry in ~{retry:.0f} s", round(retry, 1))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error!r}") from self._error

    def abort(self, request_id) -> bool:
        """Stop a request now and free its KV blocks at once; its streams end with
        finish_reason "abort". False if no unfinished request has this id."""
        with self._lock:
            group = self._groups.get(str(request_id))
            if group is None:
                return False
            pieces = []
            for r in group.children:
                if r.status is not Status.FINISHED:
                    self.scheduler.finish(r)
                    r.out.finish_reason = "abort"
                    pieces.append((group, StreamPiece("", [], r.index, None, "abort", r.num_prompt_tokens,
                                                      r.num_output_tokens)))
            self._counts["aborted"] += 1
            self._close(group)
        self._deliver(pieces)
        return True

    def abort_all(self) -> int:
        """Abort every unfinished request (a server's drain deadline); -> how many."""
        with self._lock:
            rids = list(self._groups)
        return sum(self.abort(rid) for rid in rids)

    def _close(self, group: RequestGroup) -> None:
        """Forget a finished or aborted request. Its output is kept for `result()` only when
        it was not streamed (a stream has handed every piece to its reader already)."""
        self._groups.pop(group.request_id, None)
        if group.keep_output:
            self._outputs[group.request_id] = group.output()
            while len(self._outputs) > KEEP_OUTPUTS:
                self._outputs.popitem(last=False)
        for r in group.children:
            if r.first_token_at is not None and r.num_output_tokens > 1:
                self._counts["decode_tokens"] += r.num_output_tokens - 1
                self._decode_seconds += r.last_token_at - r.first_token_at
        group.done.set()

    def result(self, request_id: str, timeout: float | None = None) -> RequestOutput:
        """Wait for a request added with add_request to finish (the engine must be running,
        or be stepped by another thread) and return its output."""
        with self._lock:
            group = self._groups.get(request_id)
            if group is None:
                if request_id in self._outputs:
                    return self._outputs[request_id]
                raise KeyError(f"no request {request_id!r} (unknown, or finished more than "
                               f"{KEEP_OUTPUTS} requests ago)")
        if not group.done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
        if group.error is not None:
            raise RuntimeError(f"the engine failed while running {request_id!r}") from group.error
        return group.output()

    # ------------------------------------------------------------------ offline batch
    def generate(self, prompts, sampling=None, *, progress: bool = False) -> list[RequestOutput]:
        """Run a batch of prompts to completion, all scheduled together; one RequestOutput per prompt,
        in order. sampling: one SamplingParams for all, or a list with one per prompt. The queue
        limits do not apply. Steps in this thread unless the engine thread is running."""
        ids, _ = _normalize_prompts(self.model, prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(ids):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(ids)} prompts")
            params = list(sampling)
        else:
            params = [sampling] * len(ids)
        groups = []
        try:
            for p, s in zip(ids, params):
                groups.append(self._add(p, s, None, None, limits=False))
            t0, shown = time.perf_counter(), 0.0
            for g in groups:
                while not g.done.is_set():
                    if self._thread is not None and self._thread.is_alive():
                        g.done.wait(0.5)
                    else:
                        self._check_alive()
                        self.step()
                    if g.error is not None:
                        raise RuntimeError("the engine failed during generate()") from g.error
                    if progress and time.perf_counter() - shown > 1.0:
                        shown = time.perf_counter()
                        done = sum(x.done.is_set() for x in groups)
                        toks = sum(c.num_output_tokens for x in groups for c in x.children)
                        print(f"[engine] {done}/{len(groups)} requests, {toks} tokens, "
                              f"{toks / (shown - t0):.1f} tok/s", file=sys.stderr, flush=True)
        except BaseException:
            for g in groups:
                self.abort(g.request_id)
            raise
        return [g.output() for g in groups]

    # ------------------------------------------------------------------ streaming
    async def stream(self, prompt, sampling: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[StreamPiece]:
        """Stream one request's pieces (async generator). Validates and queues at the first
        __anext__ (QueueFull / ValueError raise there) and starts the engine thread if needed.
        Closing the generator early (a client that went away) aborts the request and frees
        its blocks at once."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item):
            loop.call_soon_threadsafe(queue.put_nowait, item)

        group = self._add(self._one_prompt(prompt), sampling, request_id, sink, limits=True)
        group.keep_output = False           # its reader has every piece: nothing to keep for result()
        done = False
        try:
            self.start()
            left = group.params.n
            while left:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed while running {group.request_id!r}") from item
                left -= item.finish_reason is not None
                yield item
            done = True
        finally:
            if not done:
                self.abort(group.request_id)

    def _deliver(self, pieces) -> None:
        """Hand pieces to their sinks, outside the lock; a sink that fails (its event loop
        closed) gets its request aborted."""
        dead = set()
        for group, piece in pieces:
            if group.sink is None or group.request_id in dead:
                continue
            try:
                group.sink(piece)
            except Exception:
                dead.add(group.request_id)
        for rid in dead:
            self.abort(rid)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and one forward; returns the requests that finished in it."""
        with self._step_mutex:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                sched = self.scheduler
                if sched.waiting and not sched.running and not plan.preempted:   # would loop forever
                    r = sched.waiting[0]
                    raise RuntimeError(f"cannot schedule request {r.group.request_id!r} ({r.num_tokens} tokens) "
                                       f"with every block free ({self.cache.num_free_blocks} of "
                                       f"{self.cache.num_blocks}); this is a bug")
                return []
            chunks = plan.chunks
            news = [c.request.token_ids[c.start:c.start + c.num_tokens] for c in chunks]
            step = self.cache.packed([c.request.seq_id for c in chunks], [c.num_tokens for c in chunks], news,
                                     defer_prefix=True)
            rows, off = [], 0
            for c in chunks:
                off += c.num_tokens
                if c.sample:
                    rows.append(off - 1)
        t1 = time.perf_counter()
        with torch.inference_mode():
            input_ids = torch.tensor([[t for new in news for t in new]], dtype=torch.long, device=self.device)
            logits = self._forward(input_ids, step, rows)                                  # (R, V)
        pieces, finished = [], []
        with self._lock:
            step.commit()
            t2 = time.perf_counter()
            dt = t2 - t1
            self._rate = 0.8 * self._rate + 0.2 * (plan.num_tokens / dt) if self._rate else plan.num_tokens / dt
            self._counts["steps"] += 1
            for c in chunks:
                if not (c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens):
                    self._counts["prefill_tokens"] += c.num_tokens      # not a decode: prompt/recompute
                if c.request.status is Status.RUNNING:
                    c.request.num_computed_tokens = c.start + c.num_tokens
            picked = [(i, c.request) for i, c in enumerate(c for c in chunks if c.sample)
                      if c.request.status is Status.RUNNING]
            if picked:
                with torch.inference_mode():
                    sel = logits if len(picked) == len(rows) else logits[[i for i, _ in picked]]
                    tokens, logprobs = sample_rows(sel, [r for _, r in picked])
                now = time.perf_counter()
                for (_, r), tok, lp in zip(picked, tokens, logprobs):
                    pieces.append((r.group, self._append(r, tok, lp, now)))
                    if r.status is Status.FINISHED and r.group.finished:
                        self._counts["finished"] += 1
                        self._close(r.group)
                        finished.append(r.group.output())
            self._seconds["schedule"] += t1 - t0
            self._seconds["forward"] += dt
            self._seconds["output"] += time.perf_counter() - t2
        self._deliver(pieces)
        return finished

    def _forward(self, input_ids, step, rows: list[int]):
        """Logits (R, V) of the given pack rows. The output layer (a (V, C) matmul, ~20% of
        SmolLM2's weights) runs on those rows only: a hook on `model.lm_head` selects them,
        for this thread's call only."""
        sel = torch.tensor(rows, dtype=torch.long, device=self.device)
        head = getattr(self.model, "lm_head", None)
        if head is None:
            return self.model(input_ids, cache=step)[0, sel]
        me = threading.get_ident()

        def pick(module, args):
            if threading.get_ident() == me and args and args[0].dim() == 3 and args[0].shape[1] == input_ids.shape[1]:
                return (args[0].index_select(1, sel),) + tuple(args[1:])
            return None

        handle = head.register_forward_pre_hook(pick)
        try:
            logits = self.model(input_ids, cache=step)
        finally:
            handle.remove()
        return logits[0] if logits.shape[1] == len(rows) else logits[0, sel]

    def _append(self, r: Request, token: int, lp, now: float) -> StreamPiece:
        """Record a sampled token; finish the request (freeing its blocks) if it ends here."""
        if r.first_token_at is None:
            r.first_token_at = now
            self._ttft.append(now - r.group.arrival)
        else:
            self._itl.append(now - r.last_token_at)
        r.last_token_at = now
        r.token_ids.append(token)
        if r.seen is not None:
            r.seen[token] = True
        if lp is not None:
            r.out.logprobs.append(lp)
        r.out.push(token)
        self._counts["output_tokens"] += 1
        if r.out.finish_reason is not None:
            self.scheduler.finish(r)
        return StreamPiece(r.out.new_text(), [token], r.index, [lp] if lp is not None else None,
                           r.out.finish_reason, r.num_prompt_tokens, r.num_output_tokens)

    # ------------------------------------------------------------------ the thread
    def start(self) -> "Engine":
        """Start the background thread that steps while there is work (idempotent)."""
        with self._lock:
            self._check_alive()
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="headwise-engine", daemon=True)
                self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.scheduler.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            try:
                self.step()
            except BaseException as e:      # noqa: BLE001 - every waiting caller must hear of it
                self._fail(e)
                return

    def _fail(self, error: BaseException) -> None:
        pieces = []
        with self._lock:
            self._error = error
            for group in list(self._groups.values()):
                group.error = error
                for r in group.children:
                    if r.status is not Status.FINISHED:
                        self.scheduler.finish(r)
                pieces.append((group, error))
                self._close(group)
        self._deliver(pieces)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (after the step in flight) and abort every unfinished request."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.abort_all()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ numbers
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._groups)

    def stats(self) -> EngineStats:
        with self._lock:
            free = self.cache.num_free_blocks
            c = self._counts
            return EngineStats(
                running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                kv_blocks_used=self.cache.num_blocks - free, kv_blocks_free=free,
                kv_blocks_total=self.cache.num_blocks, kv_block_size=self.block_size,
                preemptions=self.scheduler.num_preemptions, prefix_cache_queries=self.scheduler.prefix_queries,
                prefix_cache_hits=self.scheduler.prefix_hits, prompt_tokens=c["prompt_tokens"],
                prefill_tokens=c["prefill_tokens"], output_tokens=c["output_tokens"],
                requests_finished=c["finished"], requests_aborted=c["aborted"], steps=c["steps"],
                step_seconds=dict(self._seconds), ttft_s=Samples(self._ttft), itl_s=Samples(self._itl),
                decode_tokens_per_second=(c["decode_tokens"] / self._decode_seconds
                                          if c["decode_tokens"] and self._decode_seconds > 0 else None))

    def __repr__(self) -> str:
        return (f"Engine({type(self.model).__name__}, max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, blocks={self.cache.num_blocks}x"
                f"{self.block_size}, max_model_len={self.max_model_len})")
