"""POST /v1/completions on a local model: text or token-id prompts (one or a list) -> the
engine; choice index = prompt index * n + choice within the prompt, as OpenAI numbers them."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from ..direct import DirectWriter
from ..errors import APIError
from ..schemas import CompletionRequest
from .common import (
    body_size,
    check_chars,
    check_context,
    check_ids,
    completion_logprobs,
    logprobs_size,
    new_id,
    off_loop,
    reject_unsupported,
    resume_of,
    sampling_params,
    tokenize,
    with_response_format,
)
from .streams import EventStream, Streams, Usage, collect, fair_share, sse_events, until_disconnect

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def prompts_of(runtime, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        items = [p]
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    vocab = runtime.model.config.vocab_size
    out = []
    for i, item in enumerate(items):
        ids = tokenize(runtime.tokenizer, item) if isinstance(item, str) else check_ids(list(item), vocab, "prompt")
        if not ids:
            raise APIError(400, f"prompt {i} is empty (0 tokens)", param="prompt")
        out.append(ids)
    return out


def prepare(runtime, req: CompletionRequest):
    """-> (prompts as ids, SamplingParams, Resume or None). CPU work (the tokenizer): call it off
    the loop. A resumed completion (headwise.resume) continues after prompt + the ids so far."""
    n = req.n or 1
    reject_unsupported(
        req,
        {
            "echo": (not req.echo, "echo is not supported"),
            "suffix": (req.suffix is None, "suffix (fill-in-the-middle) is not supported"),
            "best_of": (req.best_of in (None, n), "best_of must equal n (no server-side ranking here)"),
        },
    )
    prompts = prompts_of(runtime, req)
    vocab = runtime.model.config.vocab_size
    resume, requested = resume_of(req, prompts, vocab, req.max_tokens or DEFAULT_MAX_TOKENS)
    done = len(resume.token_ids) if resume else 0
    max_tokens = check_context([len(p) + done for p in prompts], requested, runtime.max_model_len)
    params = with_response_format(runtime, sampling_params(req, max_tokens, req.logprobs, vocab), req.response_format)
    return prompts, params, resume


async def create(runtime, req: CompletionRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("generate", "/v1/completions")
    p = req.prompt
    check_chars(
        [p] if isinstance(p, str) else [t for t in p if isinstance(t, str)], runtime.spec.max_input_chars, "prompt"
    )
    prompts, sampling, resume = await off_loop(prepare, runtime, req, size=body_size(request))
    rid, created = new_id("cmpl"), int(time.time())
    streams = Streams(runtime, rid, sampling.n, fair_share(request, req.priority))
    await streams.start(prompts, sampling, timeout, resume, DirectWriter.of(request.scope) if req.stream else None)
    usage = Usage(prompt_tokens=sum(len(p) for p in prompts), resumed=len(resume.token_ids) if resume else 0)
    total = len(prompts) * sampling.n
    ctx = (streams, rid, created, model, total, usage, runtime.tokenizer, sampling.logprobs, metrics)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(_events(*ctx, include_usage, bool(req.headwise and req.headwise.token_ids)), request)
    return JSONResponse(await until_disconnect(_collect(*ctx), request))


async def _collect(streams, rid, created, model, total, usage, tok, logprobs, metrics):
    texts, reasons, lps = await collect(streams, total, usage, metrics, model)
    # thousands of tokens x 21 alternatives to detokenize: off the loop
    lp = (
        await off_loop(
            lambda: [completion_logprobs(tok, lps[i], 0) for i in range(total)], size=logprobs_size(lps, logprobs)
        )
        if logprobs is not None
        else [None] * total
    )
    choices = [
        {"index": i, "text": texts[i], "finish_reason": reasons[i] or "length", "logprobs": lp[i]} for i in range(total)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
    }


def _events(streams, rid, created, model, total, usage, tok, logprobs, metrics, include_usage, token_ids=False):
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    offsets = [0] * total  # characters streamed so far per choice (text_offset)

    def choice(i, piece):
        lp = completion_logprobs(tok, piece.logprobs or [], offsets[i]) if logprobs is not None else None
        offsets[i] += len(piece.text)
        return {"index": i, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason}

    return sse_events(streams, head, usage, metrics, model, include_usage, choice, token_ids=token_ids)
