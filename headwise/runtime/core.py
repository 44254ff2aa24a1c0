"""The one loop: schedule -> run -> sample -> update, token ids in and token ids out.

    core = Core(model, scheduler, runner)         # or EngineCore(model, EngineConfig(...)): the paged pool
    core.add(core.request(RequestGroup("r0", [1, 2, 3], SamplingParams(temperature=0), None), 0))
    while core.scheduler.has_work():
        for out in core.step():                   # TokenOutput(request, token, logprobs)
            ...

Every way of running a model goes through `Core.step` (vLLM v1's EngineCore, small):
`headwise.generate()` steps a `StaticBatch` over one contiguous cache (batch.py), the
`Engine` and the server step the continuous-batching `Scheduler` over the paged pool
(scheduler.py, runner.py). A step: the scheduler picks the tokens to compute, the runner
packs them and runs one forward, the sampler draws each sampled row with its request's own
parameters (sampler.py), and each request takes its token through the one finish rule
(`TextSequence.push`, output.py: stop ids, stop strings, max_new_tokens); `finish` ends a
request early ("abort"), freeing what it holds.

Threads: scheduling and cache bookkeeping run under `lock`, the forward outside it, so a
caller holding the lock (add, abort) never waits for a forward. An abort frees blocks at
once, even while a step that includes the request runs: that step's writes into the freed
blocks are dropped with its result, and no block is handed out again before the step
ends, since only the stepping thread allocates.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable, NamedTuple

import torch

from ..models.executors import check_weights, model_version
from .output import OutputProcessor, check_context
from .predict import Prediction
from .request import Request, RequestGroup, Status
from .sampler import Sampler
from .sampling import SamplingParams, TokenLogprobs
from .threads import GOVERNOR, fit_threads


class TokenOutput(NamedTuple):
    """A token a step sampled for a request (already appended to it)."""

    request: Request
    token: int
    logprobs: TokenLogprobs | None


def check_decoder(model) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "causal", False) or not getattr(cfg, "lm_head", False):
        kind = getattr(cfg, "arch", type(model).__name__)
        raise ValueError(
            f"generation runs decoder language models (llama, gpt2 families); got {kind!r}, "
            f"which has no causal LM head (use headwise.embed for encoders)"
        )


class Core:
    """A model, a scheduler (what to compute), a runner (how) and the sampler, stepped as one.
    max_model_len: the longest prompt + output a request may take (the model's context, or
    less where the cache holds less)."""

    def __init__(self, model, scheduler, runner, *, max_model_len: int, lock: threading.RLock | None = None):
        check_decoder(model)
        self.model, self.scheduler, self.runner = model, scheduler, runner
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        if hasattr(scheduler, "max_model_len"):
            scheduler.max_model_len = max_model_len  # the positions a draft may reach
        self.output = OutputProcessor(getattr(model, "tokenizer", None))
        self.sampler = Sampler()
        self.lock = lock if lock is not None else threading.RLock()
        self.counts = collections.Counter()  # steps, prefill_tokens, output_tokens, draft_tokens, draft_accepted
        self.seconds = {"schedule": 0.0, "forward": 0.0, "output": 0.0}
        self.rate = 0.0  # tokens computed per second, smoothed (a queue's retry hint)
        self.model_version = None  # executors.model_version when requests were last admitted (_see_model)
        self.threads = 0  # torch threads the last step ran with: fitted to the free cores (threads.py)

    # ------------------------------------------------------------------ requests
    def check(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem when a prompt cannot run here."""
        V = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are out of range for this model's vocabulary of {V}")
        bad = [t for t in params.logit_bias or () if t >= V]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range for this model's vocabulary of {V}")
        bad = [t for t in params.prediction or () if t >= V]
        if bad:
            raise ValueError(f"prediction token id {bad[0]} is out of range for this model's vocabulary of {V}")
        check_context(len(ids), params.max_new_tokens, self.max_model_len, self.limit_source())

    def limit_source(self) -> str:
        """What max_model_len comes from, for the context error."""
        return f"the model's context of {self.model.config.max_positions} tokens"

    def request(self, group: RequestGroup, index: int) -> Request:
        """Completion `index` of a group, with its sampling state (seeded generator, seen ids)
        and its text state (detokenizer, stop strings: the finish rule)."""
        params, ids = group.params, group.prompt_token_ids
        gen = None
        if params.seed is not None:  # completion i draws from seed + i
            gen = torch.Generator(device=self.device).manual_seed(params.seed + index)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=self.device)
            seen[torch.tensor(ids, device=self.device)] = True
        text = self.output.sequence(ids, params)
        r = Request(group, index, gen, seen, token_ids=list(ids), text=text)
        if params.penalized:
            r.output_counts = torch.zeros(self.model.config.vocab_size, device=self.device)
        if params.prediction is not None:
            r.prediction = Prediction(params.prediction)
        return r

    def add(self, request: Request) -> None:
        with self.lock:
            self.scheduler.add(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request now ("stop", "length", "abort"), freeing what it holds at once."""
        with self.lock:
            if request.status is not Status.FINISHED:
                self.scheduler.finish(request)
                request.finish_reason = reason

    # ------------------------------------------------------------------ a step
    def step(self, process: Callable[[list[TokenOutput]], object] | None = None):
        """Schedule -> run -> sample -> update. -> the step's TokenOutputs, or process(outputs):
        run under the lock, before anything else can touch the requests (the front end's text).
        Which executor runs the forward (the modules, or the fused C stack) the model decides
        from what it declares (models/executors.py): a hook added between two steps is seen."""
        self.threads = fit_threads()  # in this thread: OpenMP's count is the calling thread's
        t0 = time.perf_counter()
        with self.lock:
            if self.scheduler.waiting or not self.counts["steps"]:  # requests start: with the model as it is?
                self._see_model()
            plan = self.scheduler.schedule()
            if not plan.chunks:
                return process([]) if process is not None else []
            batch = self.runner.prepare(plan.chunks)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)  # (R, V) or None
        with self.lock:
            self.runner.commit(batch)
            t2 = time.perf_counter()
            dt = t2 - t1
            self.rate = 0.8 * self.rate + 0.2 * (batch.num_tokens / dt) if self.rate else batch.num_tokens / dt
            self.counts["steps"] += 1
            picked, drafted, row = [], [], 0  # (logits row, request), (first row, chunk)
            for c in batch.chunks:
                if c.draft:
                    self.counts["draft_tokens"] += len(c.draft)
                elif not (c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens):
                    self.counts["prefill_tokens"] += c.num_tokens  # not a decode: prompt/recompute
                if c.request.status is Status.RUNNING:  # rows of requests aborted meanwhile are dropped
                    c.request.num_computed_tokens = c.start + c.num_tokens - len(c.draft)  # drafts: once verified
                    if c.sample:
                        (drafted.append((row, c)) if c.draft else picked.append((row, c.request)))
                if c.sample:  # the chunk's rows of logits: its last, or every row of a draft
                    row += 1 + len(c.draft)
            outputs = []
            with torch.inference_mode():
                if picked:
                    sel = logits if len(picked) == logits.shape[0] else logits[[i for i, _ in picked]]
                    tokens, logprobs = self.sampler.sample(sel, [r for _, r in picked])
                    outputs = [self._append(r, tok, lp) for (_, r), tok, lp in zip(picked, tokens, logprobs)]
                for first, c in drafted:
                    outputs += self._verify(c, logits[first : first + 1 + len(c.draft)])
            self._prefetch(outputs)
            result = process(outputs) if process is not None else outputs
            self.seconds["schedule"] += t1 - t0
            self.seconds["forward"] += dt
            self.seconds["output"] += time.perf_counter() - t2
        return result

    @staticmethod
    def _prefetch(outputs: list[TokenOutput]) -> None:
        """Processors that can (a grammar's masks) start on the next step while its forward runs,
        where a core is left over for them: with torch's threads on every core, the overlap only
        takes cycles from the forward (measured: docs/structured-outputs.md). Cores other processes
        keep busy (the thread governor's last reading) are not left over."""
        if (os.cpu_count() or 1) - torch.get_num_threads() - GOVERNOR.others < 0.5:
            return
        by_proc: dict[int, tuple] = {}
        for r in {id(o.request): o.request for o in outputs}.values():
            if r.status is Status.RUNNING:
                for p in r.params.logits_processors:
                    if hasattr(p, "prefetch"):
                        by_proc.setdefault(id(p), (p, []))[1].append(r)
        for p, reqs in by_proc.values():
            p.prefetch(reqs)

    def _verify(self, c, logits) -> list[TokenOutput]:
        """A decode with a draft (predict.py): logits (1 + k, V), row i after the chunk's i-th token.
        Each row is sampled with the request's state as it then is (penalties, grammar, seeded
        generator: one draw per token, as without a draft) and appended, until a token differs
        from the draft (or the request ends); the K/V of the drafts after it is dropped."""
        r, draft = c.request, c.draft
        if r.params.greedy and r.params.plain:  # a row's token depends on its logits only: one argmax
            tokens, lps = self.sampler.sample(logits, [r] * logits.shape[0])
            rows = zip(tokens, lps)
        else:
            rows = (tuple(x[0] for x in self.sampler.sample(logits[i : i + 1], [r])) for i in range(len(logits)))
        out, accepted = [], 0
        for i, (tok, lp) in enumerate(rows):
            out.append(self._append(r, tok, lp))
            if r.status is not Status.RUNNING or i == len(draft) or tok != draft[i]:
                break
            accepted += 1
        r.prediction.verified(len(draft), accepted)
        self.counts["draft_accepted"] += accepted
        if r.status is Status.RUNNING:
            r.num_computed_tokens = c.start + 1 + accepted
            self.scheduler.cache.truncate(r.seq_id, r.num_computed_tokens, r.token_ids)
        return out

    def _see_model(self) -> None:
        """Before requests are admitted: if the model changed since this core last looked (weights
        edited in place, hooks, modules replaced), K/V cached by prefix is forgotten and a fused plan
        of the old weights dropped."""
        version = model_version(self.model)
        if version != self.model_version:
            if self.model_version is not None:
                self.scheduler.model_changed()
            self.model_version = version
            check_weights(self.model)

    def _append(self, r: Request, token: int, lp) -> TokenOutput:
        """Record a sampled token; finish the request (freeing what it holds) if it ends here."""
        r.token_ids.append(token)
        r.output_token_ids.append(token)
        if r.seen is not None:
            r.seen[token] = True
        if r.prediction is not None:
            r.prediction.push(token)
        if r.output_counts is not None:
            r.output_counts[token] += 1
        if lp is not None:
            r.logprobs.append(lp)
        self.counts["output_tokens"] += 1
        r.text.push(token)  # the one finish rule
        if r.text.finish_reason is not None:
            self.finish(r, r.text.finish_reason)
        return TokenOutput(r, token, lp)
