"""`EngineCore`: one step of continuous batching, token ids in and token ids out.

    core = EngineCore(model, EngineConfig(num_blocks=128, block_size=4))
    core.add(core.request(RequestGroup("r0", [1, 2, 3], SamplingParams(temperature=0), None), 0))
    while core.scheduler.has_work():
        for out in core.step():                 # TokenOutput(request, token, logprobs)
            ...

A step: the scheduler picks tokens under a budget (scheduler.py), the runner packs them
and runs one forward (runner.py), each sampled row is drawn with its request's own
parameters (sampler.py), and the requests advance: the token is appended, and a request
that sampled a stop id or reached max_new_tokens finishes and frees its blocks. No
tokenizer and no text here: stop strings and detokenizing are the front end's (engine.py,
through generation/output.py), which finishes a request early with `finish`.

Threads: scheduling and cache bookkeeping run under `lock`, the forward outside it, so a
caller holding the lock (add, abort) never waits for a forward. An abort frees blocks at
once, even while a step that includes the request runs: that step's writes into the freed
blocks are dropped with its result, and no block is handed out again before the step
ends, since only the stepping thread allocates.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, NamedTuple

import torch

from ..cache.paged import PagedKVCache
from ..generation.sampling import SamplingParams, TokenLogprobs
from .config import EngineConfig
from .request import Request, RequestGroup, Status
from .runner import ModelRunner
from .sampler import sample_rows
from .scheduler import Scheduler


class TokenOutput(NamedTuple):
    """A token a step sampled for a request (already appended to it)."""

    request: Request
    token: int
    logprobs: TokenLogprobs | None


class EngineCore:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        *,
        lock: threading.RLock | None = None,
        model_fixed: bool = False,
    ):
        cfg = getattr(model, "config", None)
        if cfg is None or not getattr(cfg, "causal", False) or not getattr(cfg, "lm_head", False):
            kind = getattr(cfg, "arch", type(model).__name__)
            raise ValueError(
                f"the engine serves decoder language models (llama, gpt2 families); got {kind!r}, "
                f"which has no causal LM head (use headwise.embed for encoders)"
            )
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.config = (config or EngineConfig()).resolve(cfg, self.dtype)  # every size known from here
        self.max_model_len: int = self.config.max_model_len(cfg)
        c = self.config
        # Sequences start at fixed-stride regions of the pool while there is room (decodes of all of
        # them read as one strided view), else mid-way into the largest free stretch (each stays one
        # consecutive run, read in place); see cache/packed.py.
        self.cache = PagedKVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            c.num_blocks,
            c.block_size,
            dtype=self.dtype,
            device=self.device,
            kv_dtype=c.kv_dtype,
            spread=True,
            region_blocks=max(1, c.num_blocks // c.max_num_seqs),
        )
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens
        )
        self.runner = ModelRunner(model, self.cache, model_fixed=model_fixed)
        self.lock = lock if lock is not None else threading.RLock()
        self.counts = collections.Counter()  # steps, prefill_tokens, output_tokens
        self.seconds = {"schedule": 0.0, "forward": 0.0, "output": 0.0}
        self.rate = 0.0  # tokens computed per second, smoothed (a queue's retry hint)

    # ------------------------------------------------------------------ requests
    def check(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem when a prompt cannot run here."""
        V = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are out of range for this model's vocabulary of {V}")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} that "
                f"exceeds max_model_len={self.max_model_len} (the model's context of "
                f"{self.model.config.max_positions} tokens, or the KV pool's {self.cache.num_blocks} "
                f"blocks x {self.config.block_size} tokens)"
            )

    def request(self, group: RequestGroup, index: int, stop_ids: frozenset = frozenset()) -> Request:
        """Completion `index` of a group, with its sampling state (seeded generator, seen ids)."""
        params, ids = group.params, group.prompt_token_ids
        gen = None
        if params.seed is not None:  # as generate(): completion i draws from seed + i
            gen = torch.Generator(device=self.device).manual_seed(params.seed + index)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=self.device)
            seen[torch.tensor(ids, device=self.device)] = True
        return Request(
            group, index, frozenset(stop_ids) | frozenset(params.stop_token_ids), gen, seen, token_ids=list(ids)
        )

    def add(self, request: Request) -> None:
        with self.lock:
            self.scheduler.add(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request now ("stop", "length", "abort"), freeing its blocks at once."""
        with self.lock:
            if request.status is not Status.FINISHED:
                self.scheduler.finish(request)
                request.finish_reason = reason

    # ------------------------------------------------------------------ a step
    def step(self, process: Callable[[list[TokenOutput]], object] | None = None, *, vouch: object | None = None):
        """Schedule -> run -> sample -> update. -> the step's TokenOutputs, or process(outputs):
        run under the lock, before anything else can touch the requests (the front end's text).
        vouch: the caller's word that nothing changed the model since the step it last passed
        the same object to (Step.model_vouch; ignored when the engine's model is fixed)."""
        t0 = time.perf_counter()
        with self.lock:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                sched = self.scheduler
                if sched.waiting and not sched.running and not plan.preempted:  # would loop forever
                    r = sched.waiting[0]
                    raise RuntimeError(
                        f"cannot schedule request {r.group.request_id!r} ({r.num_tokens} tokens) "
                        f"with every block free ({self.cache.num_free_blocks} of "
                        f"{self.cache.num_blocks}); this is a bug"
                    )
                return process([]) if process is not None else []
            batch = self.runner.prepare(plan.chunks, vouch)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)  # (R, V) or None
        with self.lock:
            batch.step.commit()
            t2 = time.perf_counter()
            dt = t2 - t1
            self.rate = 0.8 * self.rate + 0.2 * (batch.num_tokens / dt) if self.rate else batch.num_tokens / dt
            self.counts["steps"] += 1
            for c in batch.chunks:
                if not (c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens):
                    self.counts["prefill_tokens"] += c.num_tokens  # not a decode: prompt/recompute
                if c.request.status is Status.RUNNING:
                    c.request.num_computed_tokens = c.start + c.num_tokens
            # rows of requests aborted while the forward ran are dropped here
            picked = [
                (i, c.request)
                for i, c in enumerate(c for c in batch.chunks if c.sample)
                if c.request.status is Status.RUNNING
            ]
            outputs = []
            if picked:
                with torch.inference_mode():
                    sel = logits if len(picked) == logits.shape[0] else logits[[i for i, _ in picked]]
                    tokens, logprobs = sample_rows(sel, [r for _, r in picked])
                outputs = [self._append(r, tok, lp) for (_, r), tok, lp in zip(picked, tokens, logprobs)]
            result = process(outputs) if process is not None else outputs
            self.seconds["schedule"] += t1 - t0
            self.seconds["forward"] += dt
            self.seconds["output"] += time.perf_counter() - t2
        return result

    def _append(self, r: Request, token: int, lp) -> TokenOutput:
        """Record a sampled token; finish the request (freeing its blocks) if it ends here."""
        r.token_ids.append(token)
        r.output_token_ids.append(token)
        if r.seen is not None:
            r.seen[token] = True
        if lp is not None:
            r.logprobs.append(lp)
        self.counts["output_tokens"] += 1
        if token in r.stop_ids:
            self.finish(r, "stop")
        elif r.num_output_tokens >= r.params.max_new_tokens:
            self.finish(r, "length")
        return TokenOutput(r, token, lp)
