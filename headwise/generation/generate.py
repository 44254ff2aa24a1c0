"""`generate()`: batched, streaming text generation on one process, with the contiguous cache.

Prompts of different lengths are prefilled together (right-padded; the cache
keeps per-sequence lengths), then every step feeds one token per sequence. The
prefill asks for the logits of each prompt's last real token only (the output
layer is ~20% of SmolLM2's weights per row). Prompts, text and stop strings go
through the output processor (output.py), as in the engine and the server.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..cache.quantized import is_int8
from .output import OutputProcessor
from .sampling import SamplingParams, TokenLogprobs, sample, token_logprobs


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (a final EOS/stop id included)
    finish_reason: str  # "stop" (EOS, stop id or stop string) or "length"
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

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
    kv_dtype: None keeps K/V in the model's dtype; "int8" stores them as int8 with an fp32 scale
    per (token, head) (cache/quantized.py: 0.27x fp32's bytes), which a decode step reads as
    int8 (on SmolLM2 at 4,096 tokens of context, ~1.4x the tokens/s of fp32 K/V).
    The model is taken as it is at the call: changing it from another thread while generate()
    runs is not supported (as any PyTorch forward); a stream may change it between its pieces.
    """
    params = sampling or SamplingParams()
    if fields:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise TypeError(f"unknown sampling field(s): {', '.join(unknown)}")
        params = dataclasses.replace(params, **fields)
    if is_int8(kv_dtype) and compile:
        raise ValueError(
            "kv_dtype='int8' does not combine with compile=True (its static cache holds the model's dtype)"
        )
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
    from ..cache import ContiguousKVCache

    cfg = model.config
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    limit = cfg.max_positions
    for i, n in enumerate(lengths):
        if n + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={params.max_new_tokens} that "
                f"exceeds the model's context of {limit} tokens"
            )
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    out = OutputProcessor(getattr(model, "tokenizer", None))
    stops = out.stop_ids(params)
    seqs = [out.sequence(p, params, stops) for p in prompts]
    gens = [None] * B
    if params.seed is not None:
        gens = [torch.Generator(device=device).manual_seed(params.seed + i) for i in range(B)]

    T0 = max(lengths)
    if compile:
        from .compiled import compiled_decode_step, static_cache, static_cache_size

        step_fn = compiled_decode_step(model)
        cache = static_cache(model, B, static_cache_size(T0 + params.max_new_tokens, limit), dtype=dtype, device=device)
    else:
        step_fn = None
        cache = ContiguousKVCache(
            cfg.num_layers,
            B,
            cfg.num_kv_heads,
            T0 + params.max_new_tokens,
            cfg.head_dim,
            dtype=dtype,
            device=device,
            kv_dtype=kv_dtype,
        )
    ids = torch.zeros(B, T0, dtype=torch.long, device=device)  # (B, T0), right-padded
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, cfg.vocab_size, dtype=torch.bool, device=device)  # (B, V): ids seen so far
        for b, p in enumerate(prompts):
            seen[b, torch.tensor(p, device=device)] = True

    t0 = time.perf_counter()
    with torch.inference_mode():
        lens = torch.tensor(lengths, device=device)  # (B,)
        rows = torch.arange(B, device=device) * T0 + lens - 1  # each prompt's last real token, b*T0 + t
        step = cache.step(T0, num_new=None if min(lengths) == T0 else lens, logits_indices=rows)
        last = model(ids, step)  # (B, V)
        t_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        # between the decode steps of a whole generate() no code of the user's runs (a stream
        # yields to it): the model is as the run's first step found it (Step.model_vouch)
        vouch = None if streaming else object()
        for step in range(params.max_new_tokens):
            if gens[0] is None:
                nxt = sample(last, params, seen=seen)  # (B,)
            else:
                nxt = torch.cat(
                    [
                        sample(
                            last[b : b + 1], params, seen=None if seen is None else seen[b : b + 1], generator=gens[b]
                        )
                        for b in range(B)
                    ]
                )
            if params.logprobs is not None:
                for s, lp in zip(seqs, token_logprobs(last, nxt, params.logprobs)):
                    if s.finish_reason is None:
                        s.logprobs.append(lp)
            if seen is not None:
                seen[torch.arange(B), nxt] = True
            for s, t in zip(seqs, nxt.tolist()):
                if s.finish_reason is None:
                    s.push(t)
            if streaming:
                yield seqs[0].new_text()
            if all(s.finish_reason for s in seqs):
                break
            if step_fn is None:
                decode = cache.step(1)
                decode.model_vouch = vouch
                last = model(nxt[:, None], decode)[:, -1]  # (B, V)
            else:
                cache.book(1)  # host bookkeeping, outside the graph
                last = step_fn(nxt[:, None], cache)
        t_decode = time.perf_counter() - t1
    if streaming:
        yield seqs[0].new_text()
        return seqs[0].finish_reason or "length"
    for s in seqs:
        yield GenerationResult(
            s.text,
            s.token_ids,
            s.finish_reason or "length",
            s.prompt,
            s.logprobs if params.logprobs is not None else None,
            t_prefill,
            t_decode,
        )
