"""POST /v1/chat/completions on a local model: messages -> the model's chat template ->
token ids -> the engine; the answer as one JSON or as SSE chunks."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..direct import DirectWriter
from ..errors import APIError
from ..schemas import ChatCompletionRequest
from .common import (
    chat_logprobs,
    check_chars,
    check_context,
    new_id,
    off_loop,
    reject_unsupported,
    resume_of,
    sampling_params,
    tokenize,
    with_response_format,
)
from .streams import Streams, Usage, collect, sse_events, until_disconnect


def render_prompt(tok, req: ChatCompletionRequest) -> list[int]:
    from ...runtime.output import OutputProcessor
    from ...models.chat_template import ChatTemplateError

    messages = []
    for m in req.messages:
        content = (
            m.content if isinstance(m.content, str) or m.content is None else "\n".join(part.text for part in m.content)
        )
        # "developer" is OpenAI's newer name for "system"; templates know only the latter
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    try:
        text = OutputProcessor(tok).chat_text(messages)  # the template generate() uses
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages") from None
    except ValueError:  # no template at all (Gemma 3 270M's GGUF, base models): no guessed default
        raise APIError(
            400,
            f"model {req.model!r} has no chat template (none in its tokenizer files or GGUF), so it cannot "
            "take messages: send the text as a prompt to /v1/completions instead",
            param="model",
            code="no_chat_template",
        ) from None
    ids = tokenize(tok, text, special=False)  # the template already wrote BOS/role tokens
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages")
    return ids


def message_texts(req: ChatCompletionRequest):
    for m in req.messages:
        if isinstance(m.content, str):
            yield m.content
        elif m.content:
            yield from (part.text for part in m.content)


def prepare(runtime, req: ChatCompletionRequest):
    """-> (prompt ids, SamplingParams, Resume or None). CPU work (template, tokenizer): call it off
    the loop. A resumed completion (headwise.resume) continues after the chat-templated prompt
    plus the ids generated so far, its max_tokens reduced by them."""
    reject_unsupported(
        req,
        {
            "tools": (not req.tools, "tool calling is not supported by headwise's local models"),
            "tool_choice": (
                req.tool_choice in (None, "none", "auto"),
                "tool_choice needs tools, which are not supported here",
            ),
            "top_logprobs": (req.top_logprobs is None or req.logprobs, "top_logprobs needs logprobs: true"),
        },
    )
    prompt = render_prompt(runtime.tokenizer, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    resume, requested = resume_of(req, [prompt], runtime.model.config.vocab_size, requested)
    done = len(resume.token_ids) if resume else 0
    max_tokens = check_context([len(prompt) + done], requested, runtime.max_model_len, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = with_response_format(
        runtime, sampling_params(req, max_tokens, logprobs, runtime.model.config.vocab_size), req.response_format
    )
    return prompt, params, resume


async def create(runtime, req: ChatCompletionRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("generate", "/v1/chat/completions")
    check_chars(message_texts(req), runtime.spec.max_input_chars, "messages")
    prompt, sampling, resume = await off_loop(prepare, runtime, req)
    rid, created = new_id("chatcmpl"), int(time.time())
    streams = Streams(runtime, rid, sampling.n)
    await streams.start([prompt], sampling, timeout, resume, DirectWriter.of(request.scope) if req.stream else None)
    usage = Usage(prompt_tokens=len(prompt), resumed=len(resume.token_ids) if resume else 0)
    tok, top = runtime.tokenizer, sampling.logprobs  # None: no logprobs asked for
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        ids = bool(req.headwise and req.headwise.token_ids)
        return StreamingResponse(
            _events(
                streams, rid, created, model, sampling.n, usage, tok, top, include_usage, metrics, ids, resume is None
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await until_disconnect(_collect(streams, rid, created, model, sampling.n, usage, tok, top, metrics), request)
    return JSONResponse(body)


async def _collect(streams, rid, created, model, n, usage, tok, top, metrics):
    texts, reasons, lps = await collect(streams, n, usage, metrics, model)
    # thousands of tokens x 21 alternatives to detokenize: off the loop
    logprobs = (
        await off_loop(lambda: [chat_logprobs(tok, lps[i], top) for i in range(n)]) if top is not None else [None] * n
    )
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": logprobs[i],
            "finish_reason": reasons[i] or "length",
        }
        for i in range(n)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
    }


def _events(streams, rid, created, model, n, usage, tok, top, include_usage, metrics, token_ids=False, roles=True):
    """roles: the first chunk names the assistant (not when resuming a stream that already did)."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def choice(i, piece):
        return {
            "index": i,
            "delta": {"content": piece.text} if piece.text else {},
            "logprobs": chat_logprobs(tok, piece.logprobs or [], top) if top is not None else None,
            "finish_reason": piece.finish_reason,
        }

    first = [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(n)
    ]
    return sse_events(
        streams, head, usage, metrics, model, include_usage, choice, first=first if roles else None, token_ids=token_ids
    )
