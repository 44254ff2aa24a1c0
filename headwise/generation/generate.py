"""`generate()`: batched, streaming text generation on one process, with the contiguous cache.

One run of the runtime's loop (runtime/core.py), the same the engine steps: a fixed batch
over one contiguous cache (runtime/batch.py). Prompts of different lengths are prefilled
together (right-padded; the cache keeps per-sequence lengths), then every step feeds one
token per sequence. Sampling, the finish rule (stop ids, stop strings, length) and the
text are the runtime's (sampler.py, output.py), as in the engine and the server.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..runtime.batch import ContiguousRunner, StaticBatch
from ..runtime.core import Core
from ..runtime.output import OutputProcessor, check_context
from ..runtime.request import RequestGroup
from ..runtime.sampling import SamplingParams, TokenLogprobs


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (a final EOS/stop id included)
    finish_reason: str  # "stop" (EOS, stop id or stop string) or "length"
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    threads: int = 0  # torch threads of the last step: the cores other processes leave, or a pinned
    # count (HEADWISE_THREADS; runtime/threads.py)

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate: the tokens after the first (which comes from the prefill) over the
        decode time; None when fewer than 2 tokens were generated."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n >= 1 and self.decode_seconds > 0 else None


def generate(
    model,
    prompt,
    sampling: SamplingParams | None = None,
    *,
    stream: bool = False,
    compile: bool = False,
    kv_dtype: str | None = None,
    **fields,
):
    """Generate from a decoder model.

    prompt: text, token ids, chat messages ([{"role": ..., "content": ...}]), or a
    list of those (batched; prompts may differ in length).
    sampling: a `SamplingParams`; keyword fields (max_new_tokens, temperature,
    top_k, top_p, min_p, repetition_penalty, stop, seed, ...) override it.
    Returns a `GenerationResult` (a list for a list of prompts, or for n > 1); with
    stream=True (one prompt, n == 1), an iterator of text pieces.
    compile: run each one-token decode step as one torch.compile graph (compiled.py): the
    first call per batch and cache size compiles for tens of seconds; later calls reuse it.
    kv_dtype: None: 16-bit K/V for a model with quantized weights (bfloat16 with the AVX-512
    kernels, float16 with AVX2; runtime/config.py kv_dtype_for), the model's dtype otherwise;
    "float32" keeps the model's fp32 anyway; "bfloat16" / "float16" halve the bytes and are read
    as stored by the decode kernels; "int8" stores int8 with an fp32 scale per (token, head)
    (cache/quantized.py: 0.27x fp32's bytes). Perplexity of each: docs/kv-cache.md.
    The model is taken as it is at the call: changing it from another thread while generate()
    runs is not supported (as any PyTorch forward); a stream may change it between its pieces.
    """
    params = sampling or SamplingParams()
    if fields:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise TypeError(f"unknown sampling field(s): {', '.join(unknown)}")
        params = dataclasses.replace(params, **fields)
    prompts, single = OutputProcessor(getattr(model, "tokenizer", None)).prompts(prompt)
    if stream:
        if not single or params.n != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        return _stream(model, prompts[0], params, compile, kv_dtype)
    batch = [p for p in prompts for _ in range(params.n)]
    results = list(_run(model, batch, params, streaming=False, compile=compile, kv_dtype=kv_dtype))
    return results[0] if single and params.n == 1 else results


def _stream(
    model, prompt: list[int], params: SamplingParams, compile: bool = False, kv_dtype: str | None = None
) -> Iterator[str]:
    """Text pieces; the generator's return value (StopIteration.value) is the finish reason."""
    run = _run(model, [prompt], params, streaming=True, compile=compile, kv_dtype=kv_dtype)
    while True:
        try:
            piece = next(run)
        except StopIteration as done:
            return done.value
        if piece:
            yield piece


def _run(
    model,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    streaming: bool,
    compile: bool = False,
    kv_dtype: str | None = None,
):
    """The batch as one run of the runtime's loop (runtime/core.py) over a contiguous cache."""
    limit = model.config.max_positions
    for i, p in enumerate(prompts):
        check_context(len(p), params.max_new_tokens, limit, f"the model's context of {limit} tokens", f"prompt {i}")
    B = len(prompts)
    runner = ContiguousRunner(
        model, B, max(map(len, prompts)) + params.max_new_tokens, kv_dtype=kv_dtype, compile=compile
    )
    core = Core(model, StaticBatch(), runner, max_model_len=limit)
    # completion i of a prompt draws from seed + i, as in the engine
    reqs = [core.request(RequestGroup(str(b), p, params, None), b % params.n) for b, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    t0 = time.perf_counter()
    core.step()
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        while True:
            if streaming:
                yield reqs[0].text.new_text()
            if not core.scheduler.has_work():
                break
            core.step()
    t_decode = time.perf_counter() - t1
    if streaming:
        return reqs[0].finish_reason
    for r in reqs:
        yield GenerationResult(
            r.text.text,
            r.output_token_ids,
            r.finish_reason,
            r.group.prompt_token_ids,
            r.logprobs if params.logprobs is not None else None,
            t_prefill,
            t_decode,
            core.threads,
        )
