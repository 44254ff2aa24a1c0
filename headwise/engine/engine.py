"""`Engine`: the front end of continuous batching; one background thread steps an `EngineCore`.

    engine = headwise.Engine(headwise.load("smollm2-135m-instruct"))      # or Engine(model, config=EngineConfig(...))
    outs = engine.generate(["Hi!", "Tell me a joke"], headwise.SamplingParams(temperature=0))
    async for piece in engine.stream(prompt, params): ...      # many streams share each step

Two parts, as vLLM v1: this front end (requests, threads, async streams, queue limits,
abort, stats) and the runtime's core (runtime/paged.py: the one loop of schedule -> run ->
sample -> update over the paged pool, with the one finish rule; generate() runs the same
loop). This file holds the requests, their delivery and step(); generate(), stream() and
the background thread are in frontends.py (`Frontends`, a base of `Engine`). Prompts
(text, chat, ids) become token ids through the runtime's output processor.

Threads: the core's lock guards the scheduler, the cache's bookkeeping, the requests and
the counters; the forward runs outside it. So `add_request` and `abort` never wait for a
forward, and an abort frees the request's blocks at once (core.py says why that is safe).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Callable

from ..models.linear import weight_bytes
from ..runtime.config import EngineConfig
from ..runtime.core import TokenOutput
from ..runtime.fair import check_priority
from ..runtime.output import Resume
from ..runtime.paged import EngineCore
from ..runtime.request import RequestGroup, RequestOutput, Status, StreamPiece
from ..runtime.sampling import SamplingParams, skip_draws
from ..runtime.scheduler import QueueFull
from ..runtime.threads import GOVERNOR
from .frontends import Frontends
from .stats import SAMPLES, EngineStats, Samples

KEEP_OUTPUTS = 1024  # finished outputs kept for `result()` (streams keep none)


class Engine(Frontends):
    """Continuous batching over a paged KV cache for one decoder model.

    config: an `EngineConfig` (max_num_seqs, num_blocks, block_size, max_num_batched_tokens,
    kv_dtype, max_waiting_requests, max_waiting_tokens, memory_budget_bytes: see there), or
    its fields as keywords (`Engine(model, max_num_seqs=8)`), which change `config`'s.
    add_request/stream beyond the waiting queue's bounds raise QueueFull.
    generate(), stream() and the background thread (start/shutdown) are in frontends.py.
    The model is taken as it is at each step: hooks added or weights edited between two steps
    are seen by the next (models/executors.py decides which executor runs).
    """

    def __init__(self, model, config: EngineConfig | None = None, **limits):
        config = config if config is not None else EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a headwise.engine.EngineConfig, got {type(config).__name__}")
        unknown = sorted(set(limits) - set(EngineConfig.fields()))
        if unknown:
            raise TypeError(
                f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(EngineConfig.fields())}"
            )
        self._lock = threading.RLock()  # scheduler, cache bookkeeping, requests, counters
        self.core = EngineCore(model, config.replace(**limits) if limits else config, lock=self._lock)
        self.model, self.tokenizer = model, getattr(model, "tokenizer", None)
        self.output = self.core.output
        self._wake = threading.Condition(self._lock)
        self._step_mutex = threading.Lock()  # one step at a time (thread or generate())
        self._groups: dict[str, RequestGroup] = {}  # unfinished requests
        self._outputs: collections.OrderedDict[str, RequestOutput] = collections.OrderedDict()
        self._outbox: collections.deque = collections.deque()  # (group, piece or error) not yet delivered
        self._delivering = threading.RLock()  # (a sink's failure aborts, which flushes again)
        self._fed: dict[str, RequestGroup] = {}  # streams handed pieces since the stepping thread last looked
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._ttft = collections.deque(maxlen=SAMPLES)
        self._itl = collections.deque(maxlen=SAMPLES)
        self._counts = collections.Counter()  # prompt_tokens, finished, aborted, decode_tokens
        self._decode_seconds = 0.0  # first token to last, summed over finished requests

    config = property(lambda self: self.core.config)  # resolved: every None sized for the model
    cache = property(lambda self: self.core.cache)
    scheduler = property(lambda self: self.core.scheduler)
    max_model_len = property(lambda self: self.core.max_model_len)
    block_size = property(lambda self: self.config.block_size)
    max_num_seqs = property(lambda self: self.config.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.config.max_num_batched_tokens)
    max_waiting_requests = property(lambda self: self.config.max_waiting_requests)
    max_waiting_tokens = property(lambda self: self.config.max_waiting_tokens)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        on_piece: Callable[[StreamPiece], None] | None = None,
        priority: int = 0,
        client: str | None = None,
        share: str | None = None,
    ) -> str:
        """Queue one prompt (text, token ids or chat messages); returns its request id.

        on_piece(piece) gets each `StreamPiece` in order (or an exception if the engine fails),
        from the stepping thread or from one calling abort. Without it, `result(request_id)` waits for the output.
        Raises QueueFull (nothing queued) or ValueError (bad prompt or sampling). The request
        runs once the engine is started (`start()`), or within `step()` / `generate()`.
        Fair shares (runtime/fair.py): the engine admits first whose client, then share, runs
        the fewest sequences; priority (lower first, vLLM's convention) orders equal shares;
        client: who asks (a server's hashed API key; None: this request alone); share: requests
        that count as one (a server's prompts of one API request; None: this request alone).
        """
        fair = dict(priority=priority, client=client, share=share)
        return self._add(self._one_prompt(prompt), sampling, request_id, on_piece, limits=True, **fair).request_id

    def _one_prompt(self, prompt) -> list[int]:
        ids, single = self.output.prompts(prompt)
        if not single:
            raise ValueError(f"one prompt per request; got a list of {len(ids)} prompts (use generate() for a batch)")
        return ids[0]

    def _add(self, ids: list[int], sampling, request_id, sink, *, limits: bool, resume: Resume | None = None, **fair):
        """-> the queued RequestGroup. resume: continue a completion begun elsewhere (its ids
        join the prompt; its text and seeded draws pick up where they stopped). fair: priority,
        client, share (add_request)."""
        check_priority(fair.get("priority", 0))
        params = sampling if sampling is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling must be a headwise.SamplingParams, got {type(params).__name__}")
        if resume is not None:
            if params.n != 1:
                raise ValueError(f"resume continues one completion; got n={params.n}")
            ids = list(ids) + list(resume.token_ids)
        self.core.check(ids, params)
        if params.n * len(ids) > self.max_waiting_tokens:
            raise ValueError(
                f"the prompt takes {params.n} x {len(ids)} tokens, more than the waiting queue ever "
                f"holds (max_waiting_tokens={self.max_waiting_tokens})"
            )
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        group = RequestGroup(rid, ids, params, sink, **fair)
        for i in range(params.n):
            r = self.core.request(group, i)
            if resume is not None:
                r.text.resume(resume)
                if r.generator is not None and not params.greedy:
                    skip_draws(r.generator, len(resume.token_ids), self.model.config.vocab_size)
                if r.output_counts is not None:  # the penalties count what was generated before too
                    for t in resume.token_ids:
                        r.output_counts[t] += 1
            group.children.append(r)
        with self._lock:
            self._check_alive()
            if rid in self._groups:
                raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
            if limits:
                self._check_queue(group)
            self._groups[rid] = group
            for c in group.children:
                self.core.add(c)
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
            why = (
                f"{tokens} prompt tokens are waiting and this request adds {new} "
                f"(max_waiting_tokens={self.max_waiting_tokens})"
            )
        if why:
            rate = self.core.rate
            retry = min(60.0, max(1.0, tokens / rate)) if rate > 0 else 1.0
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
            for r in group.children:
                if r.status is not Status.FINISHED:
                    self.core.finish(r, "abort")
                    self._outbox.append(
                        (group, StreamPiece("", [], r.index, None, "abort", r.num_prompt_tokens, r.num_output_tokens))
                    )
            self._counts["aborted"] += 1
            self._close(group)
        self._flush()
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
                raise KeyError(
                    f"no request {request_id!r} (unknown, or finished more than {KEEP_OUTPUTS} requests ago)"
                )
        if not group.done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
        if group.error is not None:
            raise RuntimeError(f"the engine failed while running {request_id!r}") from group.error
        return group.output()

    # ------------------------------------------------------------------ delivery
    def _flush(self) -> None:
        """Hand the outbox's pieces to their sinks, outside the lock, in the order they were made
        (a step's last token before an abort that came after it); a sink that fails (its event
        loop closed) gets its request aborted."""
        with self._delivering:  # one deliverer at a time; never taken under _lock
            while True:
                with self._lock:
                    if not self._outbox:
                        return
                    items = list(self._outbox)
                    self._outbox.clear()
                dead = set()
                for group, piece in items:
                    if group.sink is None or group.request_id in dead:
                        continue
                    try:
                        handed = group.sink(piece)
                    except Exception:
                        dead.add(group.request_id)
                        continue
                    if handed and group.reader_idle is not None:  # an async stream's reader has it now
                        self._fed[group.request_id] = group
                for rid in dead:
                    self.abort(rid)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and one forward; returns the requests that finished in it."""
        with self._step_mutex:
            finished = self.core.step(self._process)
        self._flush()
        return finished

    def _process(self, outputs: list[TokenOutput]):
        """The step's tokens -> text and stream pieces for the outbox (under the lock, before the
        next step); -> the requests that finished (the core's finish rule has run)."""
        finished, now = [], time.perf_counter()
        tokens: dict = {}  # request -> [(token, logprobs)]: a decode with a draft gives several at once
        for r, token, lp in outputs:
            tokens.setdefault(r, []).append((token, lp))
        for r, taken in tokens.items():
            if r.first_token_at is None:
                r.first_token_at = now
                self._ttft.append(now - r.group.arrival)
            else:
                gap = (now - r.last_token_at) / len(taken)  # a drafted step's tokens share its interval
                self._itl.extend([gap] * len(taken))
            r.last_token_at = now
            lps = [lp for _, lp in taken]
            piece = StreamPiece(
                r.text.new_text(),
                [t for t, _ in taken],
                r.index,
                lps if lps[0] is not None else None,
                r.finish_reason,
                r.num_prompt_tokens,
                r.num_output_tokens,
                *r.prediction_counts,
            )
            self._outbox.append((r.group, piece))
            if r.status is Status.FINISHED and r.group.finished:
                self._counts["finished"] += 1
                self._close(r.group)
                finished.append(r.group.output())
        return finished

    # ------------------------------------------------------------------ numbers
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._groups)

    def stats(self) -> EngineStats:
        with self._lock:
            free, core, sched = self.cache.num_free_blocks, self.core.counts, self.scheduler
            c = self._counts
            return EngineStats(
                running=len(sched.running),
                waiting=len(sched.waiting),
                kv_blocks_used=self.cache.num_blocks - free,
                kv_blocks_free=free,
                kv_blocks_total=self.cache.num_blocks,
                kv_block_size=self.block_size,
                preemptions=sched.num_preemptions,
                prefix_cache_queries=sched.prefix_queries,
                prefix_cache_hits=sched.prefix_hits,
                prompt_tokens=c["prompt_tokens"],
                prefill_tokens=core["prefill_tokens"],
                output_tokens=core["output_tokens"],
                requests_finished=c["finished"],
                requests_aborted=c["aborted"],
                steps=core["steps"],
                step_seconds=dict(self.core.seconds),
                ttft_s=Samples(self._ttft),
                itl_s=Samples(self._itl),
                decode_tokens_per_second=(
                    c["decode_tokens"] / self._decode_seconds
                    if c["decode_tokens"] and self._decode_seconds > 0
                    else None
                ),
                weight_bytes=weight_bytes(self.model),
                draft_tokens=core["draft_tokens"],
                draft_tokens_accepted=core["draft_accepted"],
                threads=self.core.threads or GOVERNOR.planned(),  # before the first step: what it will take
            )

    def kv_pool_line(self) -> str:
        """The KV pool as a person reads it: "KV pool: 23,296 tokens, 1.07 GB (global 18 layers)";
        per layer type where the layers differ in window (a sliding layer holds its last W only)."""
        info = self.core.pool_info()
        types = ", ".join(
            f"{t['layers']} {_layer_type(t['window'])} layers {t['kv_bytes_per_token'] / 1024:.1f} KiB/token"
            for t in info["layer_types"]
        )
        return f"KV pool: {info['tokens']:,} tokens, {info['bytes'] / 1e9:.2f} GB ({types})"

    def __repr__(self) -> str:
        return (
            f"Engine({type(self.model).__name__}, max_num_seqs={self.max_num_seqs}, "
            f"max_num_batched_tokens={self.max_num_batched_tokens}, blocks={self.cache.num_blocks}x"
            f"{self.block_size}, max_model_len={self.max_model_len}; {self.kv_pool_line()})"
        )


def _layer_type(window: int | None) -> str:
    return "global" if window is None else f"sliding-{window}"
