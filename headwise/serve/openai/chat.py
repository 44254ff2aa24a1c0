"""POST /v1/chat/completions on a local model: messages -> the model's chat template ->
token ids -> the engine; the answer as one JSON or as SSE chunks. Tools: tools.py (the plan, the
prompt, the grammar) and tool_calls.py (the calls read back from the text), docs/tools.md."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from ..direct import DirectWriter
from ..errors import APIError
from ..schemas import ChatCompletionRequest
from .common import (
    body_size,
    chat_logprobs,
    check_chars,
    check_context,
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
from .tool_calls import CallParser, delta_chunks
from .tools import ToolPlan, plan, template_messages, text_grammar_of, with_tools

_PLAN = object()  # render_prompt's default: plan the request's tools from the tokenizer


def render_prompt(tok, req: ChatCompletionRequest, tools: ToolPlan | None = _PLAN) -> list[int]:  # type: ignore[assignment]
    """The request's messages (and tools) through the model's chat template, as token ids."""
    from ...runtime.output import OutputProcessor
    from ...models.chat_template import ChatTemplateError

    if tools is _PLAN:
        tools = plan(tok, req)
    messages, context = template_messages(req, tools)
    try:
        text = OutputProcessor(tok).chat_text(messages, **context)  # the template generate() uses
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


def prediction_text(req: ChatCompletionRequest) -> str:
    content = req.prediction.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def prepare(runtime, req: ChatCompletionRequest):
    """-> (prompt ids, SamplingParams, Resume or None). CPU work (template, tokenizer): call it off
    the loop. A resumed completion (headwise.resume) continues after the chat-templated prompt
    plus the ids generated so far, its max_tokens reduced by them. With tools: prepare_tools."""
    return prepare_tools(runtime, req)[:3]


def prepare_tools(runtime, req: ChatCompletionRequest):
    """-> (prompt ids, SamplingParams, Resume or None, ToolPlan or None): prepare, plus the plan of
    the request's tools (its `calls`: whether the text holds calls to read with tool_calls.CallParser)."""
    reject_unsupported(
        req, {"top_logprobs": (req.top_logprobs is None or req.logprobs, "top_logprobs needs logprobs: true")}
    )
    tools = plan(runtime.tokenizer, req, runtime=runtime)
    if tools is not None and tools.calls and req.headwise and req.headwise.resume:
        raise APIError(400, "headwise.resume cannot continue a completion with tool calls", param="headwise.resume")
    prompt = render_prompt(runtime.tokenizer, req, tools)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    resume, requested = resume_of(req, [prompt], runtime.model.config.vocab_size, requested)
    done = len(resume.token_ids) if resume else 0
    max_tokens = check_context([len(prompt) + done], requested, runtime.max_model_len, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs, runtime.model.config.vocab_size)
    if req.prediction is not None:  # Predicted Outputs: the text as token ids (docs/predicted-outputs.md)
        text = prediction_text(req)
        ids = tokenize(runtime.tokenizer, text, special=False) if text else []
        params = dataclasses.replace(params, prediction=tuple(ids) or None)
    if tools is not None and tools.calls:  # the tool grammar holds the response_format's for auto's text
        return prompt, with_tools(runtime, params, tools, text_grammar_of(req.response_format)), resume, tools
    return prompt, with_response_format(runtime, params, req.response_format), resume, tools


async def create(runtime, req: ChatCompletionRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("generate", "/v1/chat/completions")
    check_chars(message_texts(req), runtime.spec.max_input_chars, "messages")
    if req.prediction is not None:
        check_chars([prediction_text(req)], runtime.spec.max_input_chars, "prediction")
    prompt, sampling, resume, tools = await off_loop(prepare_tools, runtime, req, size=body_size(request))
    calls = tools if tools is not None and tools.calls else None  # the text holds calls to read
    rid, created = new_id("chatcmpl"), int(time.time())
    streams = Streams(runtime, rid, sampling.n, fair_share(request, req.priority))
    await streams.start([prompt], sampling, timeout, resume, DirectWriter.of(request.scope) if req.stream else None)
    usage = Usage(
        prompt_tokens=len(prompt), resumed=len(resume.token_ids) if resume else 0, predicted=req.prediction is not None
    )
    tok, top = runtime.tokenizer, sampling.logprobs  # None: no logprobs asked for
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        ids = bool(req.headwise and req.headwise.token_ids)
        return EventStream(
            _events(
                streams,
                rid,
                created,
                model,
                sampling.n,
                usage,
                tok,
                top,
                include_usage,
                metrics,
                ids,
                resume is None,
                calls,
            ),
            request,
        )
    body = await until_disconnect(
        _collect(streams, rid, created, model, sampling.n, usage, tok, top, metrics, calls), request
    )
    return JSONResponse(body)


async def _collect(streams, rid, created, model, n, usage, tok, top, metrics, calls=None):
    texts, reasons, lps = await collect(streams, n, usage, metrics, model)
    # thousands of tokens x 21 alternatives to detokenize: off the loop
    logprobs = (
        await off_loop(lambda: [chat_logprobs(tok, lps[i], top) for i in range(n)], size=logprobs_size(lps, top))
        if top is not None
        else [None] * n
    )
    choices = []
    for i in range(n):
        message, reason = {"role": "assistant", "content": texts[i]}, reasons[i] or "length"
        if calls is not None:
            parser = CallParser(calls.fmt)
            parser.feed(texts[i], final=True)
            message, reason = parser.message(reason)
        choices.append({"index": i, "message": message, "logprobs": logprobs[i], "finish_reason": reason})
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
    }


def _events(
    streams, rid, created, model, n, usage, tok, top, include_usage, metrics, token_ids=False, roles=True, calls=None
):
    """roles: the first chunk names the assistant (not when resuming a stream that already did).
    calls: the ToolPlan whose calls the text holds (tool_calls deltas), None: plain text."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    parsers = {}

    def choice(i, piece):
        lps = chat_logprobs(tok, piece.logprobs or [], top) if top is not None else None
        if calls is None:
            delta = {"content": piece.text} if piece.text else {}
            return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": piece.finish_reason}
        parser = parsers.setdefault(i, CallParser(calls.fmt))
        made = delta_chunks(parser, piece.text, piece.finish_reason)
        if not made and piece.logprobs and lps is not None:
            made = [({}, None)]
        out = [{"index": i, "delta": d, "logprobs": None, "finish_reason": r} for d, r in made]
        if out:
            out[0]["logprobs"] = lps
        return out

    content = None if calls is not None and calls.choice != "auto" else ""  # calls only: null, as OpenAI
    first = [
        {"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}
        for i in range(n)
    ]
    return sse_events(
        streams, head, usage, metrics, model, include_usage, choice, first=first if roles else None, token_ids=token_ids
    )
