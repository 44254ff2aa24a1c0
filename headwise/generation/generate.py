"""`generate()`: batched, streaming text generation on one process, with the contiguous cache.

Prompts of different lengths are prefilled together (right-padded; the cache
keeps per-sequence lengths), then every step feeds one token per sequence.
Text is built with an incremental detokenizer, so a streamed piece never splits
a UTF-8 character, and stop strings are found even when they straddle tokens;
while streaming, text that could still become a stop string is held back.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .sampling import SamplingParams, TokenLogprobs, sample, token_logprobs


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]                      # generated ids (a final EOS/stop id included)
    finish_reason: str                        # "stop" (EOS, stop id or stop string) or "length"
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


class _StopScan:
    """Where the text stands against each stop string, updated one new character at a time
    (Knuth, Morris & Pratt 1977): state[j] is the length of the longest prefix of stop j that
    the text ends with. A push then costs O(new characters) per stop (amortized), however long
    the text or the stops are; a full rescan per token was O(text) per stop, O(text^2) per
    sequence. state also says how much of the tail could still become a stop (held back when
    streaming). `compared` counts character comparisons: the work, for tests."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)
        self.compared = 0

    def feed(self, text: str, start: int) -> int | None:
        """Scan text[start:] (the new piece); -> where the earliest stop found in it begins, or None."""
        piece = text[start:]
        best = None
        for j, s in enumerate(self.stops):
            k, fail, n = self.state[j], self.fail[j], len(s)
            if k == 0 and s[0] not in piece:          # the common case, at C speed
                self.compared += len(piece)
                continue
            for i, c in enumerate(piece):
                while k and s[k] != c:
                    k = fail[k - 1]
                    self.compared += 1
                self.compared += 1
                if s[k] == c:
                    k += 1
                if k == n:                            # earliest end is the earliest start for this stop
                    begin = start + i + 1 - n
                    best = begin if best is None else min(best, begin)
                    break
            self.state[j] = k
        return best

    def held(self) -> int:
        """Characters at the end of the text that are a proper prefix of some stop."""
        return max(self.state, default=0)


def _failure(s: str) -> list[int]:
    """KMP failure table: f[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


@dataclass
class _Sequence:
    """Per-sequence state while decoding: tokens, text, stop detection."""
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    decoder: object | None                    # StreamDecoder or None (no tokenizer)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0                          # chars of text already streamed
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    stops: _StopScan | None = None

    def __post_init__(self):
        self.stops = _StopScan(self.params.stop)

    def push(self, token: int) -> None:
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return
        if self.decoder is not None:
            before = len(self.text)
            self.text += self.decoder.push(token)
            hit = self.stops.feed(self.text, before) if self.params.stop else None
            if hit is not None:
                self.text = self.text[:hit]
                self.finish_reason = "stop"
                return
        if len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            if self.decoder is not None:
                self.text += self.decoder.flush()

    def new_text(self) -> str:
        """Text that is safe to stream now: all of it once finished, else all but a tail
        that could still grow into a stop string."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self.stops.held()
        piece = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], dict)


def _normalize_prompts(model, prompt) -> tuple[list[list[int]], bool]:
    """-> (list of token-id prompts, single?) from str / ids / chat messages, or a list of them.
    A tensor of ids is one prompt when 1-D (T,) and a batch when 2-D (B, T)."""
    if isinstance(prompt, torch.Tensor) and (prompt.dim() not in (1, 2) or prompt.is_floating_point()):
        raise ValueError(f"a tensor prompt must hold integer token ids, (T,) or (B, T); got {prompt.dtype} "
                         f"{tuple(prompt.shape)}")
    single = isinstance(prompt, str) or _is_chat(prompt) or (
        isinstance(prompt, torch.Tensor) and prompt.dim() == 1) or (
        isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], int))
    items = [prompt] if single else list(prompt)
    if not items:
        raise ValueError("no prompts given")
    tok = getattr(model, "tokenizer", None)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str) or _is_chat(p):
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            if _is_chat(p):
                ids = tok.encode(tok.apply_chat_template(p, add_generation_prompt=True), add_special_tokens=False)
            else:
                ids = tok.encode(p)
        elif isinstance(p, torch.Tensor):
            ids = p.reshape(-1).tolist()
        else:
            ids = list(p)
        if not ids:
            raise ValueError(f"prompt {i} is empty (0 tokens); give at least one token")
        out.append([int(t) for t in ids])
    return out, single


def generate(model, prompt, sampling: SamplingParams | None = None, *, stream: bool = False,
             compile: bool = False, **fields):
    """Generate from a decoder model.

    prompt: text, token ids, chat messages ([{"role": ..., "content": ...}]), or a
    list of those (batched; prompts may differ in length).
    sampling: a `SamplingParams`; keyword fields (max_new_tokens, temperature,
    top_k, top_p, min_p, repetition_penalty, stop, seed, ...) override it.
    Returns a `GenerationResult` (a list for a list of prompts, or for n > 1); with
    stream=True (one prompt, n == 1), an iterator of text pieces.
    compile: run each one-token decode step as one torch.compile graph (compiled.py): the
    first call per batch and cache size compiles for tens of seconds; later calls reuse it.
    """
    params = sampling or SamplingParams()
    if fields:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise TypeError(f"unknown sampling field(s): {', '.join(unknown)}")
        params = dataclasses.replace(params, **fields)
    prompts, single = _normalize_prompts(model, prompt)
    if stream:
        if not single or params.n != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        return _stream(model, prompts[0], params, compile)
    results = list(_run(model, [p for p in prompts for _ in range(params.n)], params, streaming=False,
                        compile=compile))
    return results[0] if single and params.n == 1 else results


def _stream(model, prompt: list[int], params: SamplingParams, compile: bool = False) -> Iterator[str]:
    """Text pieces; the generator's return value (StopIteration.value) is the finish reason."""
    run = _run(model, [prompt], params, streaming=True, compile=compile)
    while True:
        try:
            piece = next(run)
        except StopIteration as done:
            return done.value
        if piece:
            yield piece


def _run(model, prompts: Sequence[list[int]], params: SamplingParams, streaming: bool, compile: bool = False):
    from ..cache import ContiguousKVCache
    cfg = model.config
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    limit = cfg.max_positions
    for i, n in enumerate(lengths):
        if n + params.max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {n} tokens; with max_new_tokens={params.max_new_tokens} that "
                             f"exceeds the model's context of {limit} tokens")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    tok = getattr(model, "tokenizer", None)
    stop_ids = _stop_ids(tok, params)
    seqs = [_Sequence(p, params, stop_ids, _stream_decoder(tok)) for p in prompts]
    gens = [None] * B
    if params.seed is not None:
        gens = [torch.Generator(device=device).manual_seed(params.seed + i) for i in range(B)]

    T0 = max(lengths)
    if compile:
        from .compiled import compiled_decode_step, static_cache, static_cache_size
        step_fn = compiled_decode_step(model)
        cache = static_cache(model, B, static_cache_size(T0 + params.max_new_tokens, limit), dtype=dtype,
                             device=device)
    else:
        step_fn = None
        cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, T0 + params.max_new_tokens, cfg.head_dim,
                                  dtype=dtype, device=device)
    ids = torch.zeros(B, T0, dtype=torch.long, device=device)
    mask = torch.zeros(B, T0, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
        mask[b, : len(p)] = 1
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, model_vocab(model), dtype=torch.bool, device=device)
        seen.scatter_(1, ids, mask.bool())

    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids, cache=cache, attention_mask=None if min(lengths) == T0 else mask)
        last = logits[torch.arange(B, device=device), torch.tensor(lengths, device=device) - 1]   # (B, V)
        t_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(params.max_new_tokens):
            if gens[0] is None:
                nxt = sample(last, params, seen=seen)                                   # (B,)
            else:
                nxt = torch.cat([sample(last[b:b + 1], params, seen=None if seen is None else seen[b:b + 1],
                                        generator=gens[b]) for b in range(B)])
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
                last = model(nxt[:, None], cache=cache)[:, -1]                         # (B, V)
            else:
                cache.book(1)                                   # host bookkeeping, outside the graph
                last = step_fn(nxt[:, None], cache)
        t_decode = time.perf_counter() - t1
    if streaming:
        yield seqs[0].new_text()
        return seqs[0].finish_reason or "length"
    for s in seqs:
        yield GenerationResult(s.text, s.token_ids, s.finish_reason or "length", s.prompt,
                               s.logprobs if params.logprobs is not None else None, t_prefill, t_decode)


def _stop_ids(tok, params: SamplingParams) -> frozenset:
    """Token ids that end a sequence: stop_token_ids, plus the tokenizer's end-of-turn/EOS ids
    unless ignore_eos (a model without a tokenizer has no EOS here)."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos or tok is None
                                               else frozenset(getattr(tok, "stop_token_ids", None)
                                                              or {tok.eos_token_id}))


def _stream_decoder(tok):
    if tok is None:
        return None
    from ..models.tokenizer import StreamDecoder
    return StreamDecoder(tok)


def model_vocab(model) -> int:
    return model.config.vocab_size
