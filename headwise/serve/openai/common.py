"""What chat and completions share: OpenAI fields -> SamplingParams, the context-length
check, tokenizing off the loop, SSE framing, logprobs. Running the engine streams: streams.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import json
import logging
import threading
import uuid

from ..errors import APIError
from ..middleware import PEER
from ..schemas import SamplingFields

log = logging.getLogger("headwise.serve")


# CPU work of a request (chat templates, tokenizing, detokenizing logprobs) runs here, not on
# the event loop: a 4 MiB prompt takes seconds to tokenize, and on the loop every other request
# and stream (and /health) waited for it. Pools of their own, so that huge requests queue here
# rather than in the loop's default executor, in lanes (issue 43):
# - by size: first come, first served let eight 3.8 MiB bodies keep a one-line chat waiting 10 s;
#   a job that says it is small (SMALL_JOB) waits only for other small ones;
# - by model: a model whose chat template renders slowly (up to its budget, chat_template.Limits:
#   2M steps, ~1 s on Zen 4) filled the shared pool and another model's requests timed out at 60 s; each model's
#   jobs now wait only for that model's. Threads start as jobs come (ThreadPoolExecutor), so a
#   lane costs nothing until its model is asked for something.
SMALL_WORKERS, BIG_WORKERS = 2, 4  # per model: a small lane and a big one
SMALL_JOB = 64 << 10  # bytes of text a job reads or writes: under this, a few ms of tokenizing


class _Lanes:
    """A model's (or the shared, model-less) small and big pools, made on first use."""

    def __init__(self):
        self._lanes: dict[str | None, tuple] = {}
        self._lock = threading.Lock()

    def pool(self, model: str | None, small: bool) -> concurrent.futures.ThreadPoolExecutor:
        lanes = self._lanes.get(model)
        if lanes is None:
            with self._lock:
                lanes = self._lanes.get(model)
                if lanes is None:
                    tag = "" if model is None else f"-{model}"[:24]
                    lanes = self._lanes[model] = (
                        concurrent.futures.ThreadPoolExecutor(SMALL_WORKERS, f"headwise-cpu-small{tag}"),
                        concurrent.futures.ThreadPoolExecutor(BIG_WORKERS, f"headwise-cpu{tag}"),
                    )
        return lanes[0] if small else lanes[1]


_LANES = _Lanes()


async def off_loop(fn, *args, size: int | None = None, lane: str | None = None, **kwargs):
    """fn(*args, **kwargs) on a worker thread, in this request's context (middleware.PEER); its
    exceptions (APIError included) re-raised here. size: about the bytes of text fn works on
    (body_size); at most SMALL_JOB, it runs in the small lane (unknown: the big one). lane: the
    model whose lanes take the job; by default the model of a runtime passed first (chat's and
    completions' prepare(runtime, req)), else the lanes of jobs of no model."""
    if lane is None and args:
        lane = getattr(getattr(args[0], "spec", None), "name", None)
    pool = _LANES.pool(lane, size is not None and size <= SMALL_JOB)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, call)


def body_size(request) -> int | None:
    """The request body's length (Content-Length; None when unknown: a chunked upload), which
    bounds the text its CPU work reads: messages, tools, schemas."""
    n = request.headers.get("content-length", "") if request is not None else ""
    return int(n) if n.isascii() and n.isdigit() else None


def logprobs_size(lps: list[list], top: int | None) -> int:
    """About the bytes the logprobs of these tokens take as text (off_loop's size)."""
    return sum(map(len, lps)) * ((top or 0) + 1) * 48


def check_chars(texts, limit: int, param: str) -> None:
    """400 before tokenizing when the text of a request is over the model's max_input_chars."""
    n = sum(len(t) for t in texts)
    if n > limit:
        raise APIError(
            400,
            f"the {param} has {n:,} characters, over this model's limit of {limit:,} per request "
            f"([models.NAME] max_input_chars); send less text",
            param=param,
            code="input_too_long",
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # json.dumps would build one per call


def sse(obj) -> bytes:
    return b"data: " + _ENCODE(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


SAMPLING_EPS = 1e-5


def reject_unsupported(req: SamplingFields, extra: dict | None = None) -> None:
    """Fields we accept only at their neutral value: say so instead of ignoring them.
    reasoning_effort changes what a reasoning model answers; no model served here reasons, so
    only "none" is neutral (OpenAI answers the same 400 for a model that does not reason)."""
    effort = getattr(req, "reasoning_effort", None)
    extra = {
        **(extra or {}),
        "reasoning_effort": (
            effort in (None, "none"),
            f"reasoning_effort={effort!r} is not supported: the models served here do not reason, to them it "
            'is an unknown field; omit it or send "none"',
        ),
    }
    for param, (ok, message) in extra.items():
        if not ok:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def logit_bias_of(req: SamplingFields, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) -> {id: bias}; a key that is not a token id of
    this model is a 400 naming it (param logit_bias)."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        tid = int(key) if key.isascii() and key.isdigit() else None
        if tid is None or (vocab is not None and tid >= vocab):
            why = "is not a token id" if tid is None else f"is outside the vocabulary (size {vocab})"
            raise APIError(400, f"logit_bias key {key!r} {why}", param="logit_bias", code="invalid_logit_bias")
        out[tid] = float(bias)
    return out or None


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, vocab: int | None = None):
    """vocab: the model's vocabulary size, which logit_bias ids must be under."""
    from ...runtime.sampling import SamplingParams

    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    if temperature < SAMPLING_EPS:
        temperature = 0.0  # logits / 1e-300 overflow to inf; vLLM treats these as greedy too
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias_of(req, vocab),
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            seed=req.seed,
            n=req.n or 1,
            logprobs=logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_sampling") from None


def with_response_format(runtime, params, fmt):
    """params plus the grammar processor enforcing response_format (docs/structured-outputs.md);
    params unchanged for none or "text". A schema that is wrong, or uses a feature the grammar
    library does not implement, is a 400 naming it (param response_format), never ignored."""
    if fmt is None or fmt.type == "text":
        return params
    import dataclasses

    from ...runtime.grammar import grammar_processor

    def bad(message: str) -> APIError:
        return APIError(400, f"response_format: {message}", param="response_format", code="invalid_response_format")

    if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        raise bad('{"type": "json_schema"} needs json_schema.schema, the JSON Schema the output must match')
    if fmt.type == "regex" and not fmt.pattern:
        raise bad('{"type": "regex"} needs a pattern')
    if runtime.tokenizer is None:
        raise bad("this model has no tokenizer, which a grammar needs")
    try:
        proc = grammar_processor(
            runtime.tokenizer, fmt.model_dump(by_alias=True), vocab_size=runtime.model.config.vocab_size
        )
    except ValueError as e:
        raise bad(str(e)) from None
    except ImportError as e:  # the [structured] extra is not installed on this server
        raise bad(f"{fmt.type} is not available here ({e})") from None
    return dataclasses.replace(params, logits_processors=(*params.logits_processors, proc))


def check_context(prompt_lens: list[int], max_tokens: int | None, limit: int, what: str = "prompt") -> int:
    """-> max_tokens (defaulting to what is left of the context); 400 context_length_exceeded
    when a prompt plus max_tokens does not fit."""
    longest = max(prompt_lens)
    if longest >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, the {what} "
            f"has {longest} tokens, which leaves no room for the completion. Please reduce the "
            f"length of the {what}.",
            param="messages" if what == "messages" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = limit - longest
    if longest + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the {what}, {max_tokens} for the "
            f"completion). Please reduce the length of the {what} or of max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def resume_of(req: SamplingFields, prompts: list[list[int]], vocab: int, requested: int | None):
    """-> (runtime.output.Resume or None, max_tokens left for this run) from the request's
    headwise.resume: a completion another replica began, continued here (serve/failover.py)."""
    hw = req.headwise
    if hw is None or hw.resume is None:
        return None, requested
    require_peer()
    from ...runtime.output import Resume

    ids = hw.resume.token_ids
    if len(prompts) != 1 or (req.n or 1) != 1:
        raise APIError(
            400, "headwise.resume continues one completion: send one prompt and n = 1", param="headwise.resume"
        )
    check_ids(ids, vocab, "headwise.resume.token_ids")
    left = None
    if requested is not None:
        left = requested - len(ids)
        if left < 1:
            raise APIError(
                400,
                f"headwise.resume holds {len(ids)} tokens and max_tokens is {requested}: nothing is left to "
                "generate; raise max_tokens or drop the resume",
                param="max_tokens",
            )
    return Resume(tuple(ids), hw.resume.text_chars), left


def require_peer() -> None:
    """headwise.resume is for a gateway's replicas only ([server] accept_resume, middleware.py):
    400 for anyone else. It costs the server work a client should not be able to ask for (the
    ids are read as output so far, a seed's draws replayed)."""
    if not PEER.get():
        raise APIError(
            400,
            "headwise.resume is internal to headwise's replica failover; this server accepts it only from "
            "a request with one of its API keys ([server] accept_resume); remove it",
            param="headwise.resume",
            code="internal_field",
        )


def tokenize(tok, text: str, *, special: bool = True) -> list[int]:
    try:
        # encode_batch, not encode: HF tokenizers' encode holds the GIL while it works (4 MiB:
        # seconds in which no other thread, the event loop included, runs); encode_batch lets go
        return tok.encode_batch([text], add_special_tokens=special)[0]
    except Exception as e:  # lone surrogates and the like: the client's text, not our bug
        raise APIError(400, f"could not tokenize the input: {type(e).__name__}: {e}", code="invalid_text") from None


def tokenize_many(tok, texts: list[str], *, special: bool = True) -> list[list[int]]:
    try:
        return tok.encode_batch(texts, add_special_tokens=special)
    except Exception:  # find the text that fails, for the message
        return [tokenize(tok, t, special=special) for t in texts]


def check_ids(ids: list[int], vocab: int, param: str) -> list[int]:
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param=param)
    return ids


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id])


def chat_logprobs(tok, items, top: int) -> dict:
    def entry(tid, lp):
        text = _token_text(tok, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top[:top]]} for t in items
        ]
    }


def completion_logprobs(tok, items, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for t in items:
        text = _token_text(tok, t.token_id)
        tokens.append(text)
        lps.append(t.logprob)
        # OpenAI: "the logprob of the sampled token is always returned": up to logprobs + 1 entries
        tops.append({**{_token_text(tok, i): lp for i, lp in t.top}, text: t.logprob})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
