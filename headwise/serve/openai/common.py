"""What chat and completions share: OpenAI fields -> SamplingParams, the context-length
check, running engine streams (several prompts merged), SSE framing, logprobs, usage.

Nothing is sent to the client before the first piece of every stream has arrived,
so overload (429), bad input (400) and timeouts are still proper HTTP errors that
the gateway may retry elsewhere; after that, an error travels inside the stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from ..errors import APIError
from ..schemas import SamplingFields

log = logging.getLogger("headwise.serve")


# CPU work of a request (chat templates, tokenizing, detokenizing logprobs) runs here, not on
# the event loop: a 4 MiB prompt takes seconds to tokenize, and on the loop every other request
# and stream (and /health) waited for it. A pool of its own, so that huge requests queue here
# rather than in the loop's default executor.
_CPU = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="headwise-cpu")


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread; its exceptions (APIError included) re-raised here."""
    return await asyncio.get_running_loop().run_in_executor(_CPU, functools.partial(fn, *args, **kwargs))


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
    """Fields we accept only at their neutral value: say so instead of ignoring them."""
    checks = {
        "presence_penalty": (
            req.presence_penalty in (None, 0),
            "presence_penalty is not supported; use repetition_penalty",
        ),
        "frequency_penalty": (
            req.frequency_penalty in (None, 0),
            "frequency_penalty is not supported; use repetition_penalty",
        ),
        "logit_bias": (not req.logit_bias, "logit_bias is not supported"),
        **(extra or {}),
    }
    for param, (ok, message) in checks.items():
        if not ok:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None):
    from ...generation.sampling import SamplingParams

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
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            seed=req.seed,
            n=req.n or 1,
            logprobs=logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_sampling") from None


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
    """-> (generation.output.Resume or None, max_tokens left for this run) from the request's
    headwise.resume: a completion another replica began, continued here (serve/failover.py)."""
    hw = req.headwise
    if hw is None or hw.resume is None:
        return None, requested
    from ...generation.output import Resume

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


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated
    resumed: int = 0  # tokens another server generated before this one resumed (headwise.resume)

    def as_dict(self) -> dict:
        c = sum(self.completion.values()) + self.resumed
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c, "total_tokens": self.prompt_tokens + c}


class Streams:
    """The engine streams of one API request (one per prompt; each carries n choices).

    `await start(...)` enqueues every prompt and waits for each first piece; then
    `async for choice, piece in streams` yields pieces as they come, with the global
    choice index (prompt * n + piece.index). `close()` aborts whatever still runs.
    """

    def __init__(self, runtime, request_id: str, n: int):
        self.runtime, self.request_id, self.n = runtime, request_id, n
        self.gens: list = []
        self.firsts: list = []
        self.t_start = time.perf_counter()
        self.direct = None  # serve/direct.py's writer, when one engine stream of one choice takes it

    async def start(self, prompts: list[list[int]], sampling, timeout: float | None, resume=None, direct=None) -> None:
        """direct: a DirectWriter (streamed answers): used when there is one prompt and n = 1."""
        if direct is not None and len(prompts) == 1 and self.n == 1:
            self.direct = direct
        extra = {"direct": self.direct} if self.direct is not None else {}
        try:
            async with asyncio.timeout(timeout):
                for p, ids in enumerate(prompts):
                    gen = self.runtime.stream(
                        ids, sampling, request_id=f"{self.request_id}-{p}", resume=resume, **extra
                    )
                    self.gens.append(gen)
                    self.firsts.append(await anext(gen, None))
        except TimeoutError:
            await self.close()
            raise APIError(
                504, f"model {self.runtime.name!r} sent nothing within {timeout:g} s", code="timeout"
            ) from None
        except BaseException:
            await self.close()
            raise

    async def __aiter__(self):
        if len(self.gens) == 1:
            if self.firsts[0] is not None:
                yield self.firsts[0].index, self.firsts[0]
                async for piece in self.gens[0]:
                    yield piece.index, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p, gen, first):
            try:
                if first is not None:
                    await queue.put((p, first))
                    async for piece in gen:
                        await queue.put((p, piece))
                await queue.put((p, None))
            except BaseException as e:  # hand errors to the consumer
                await queue.put((p, e))

        tasks = [asyncio.create_task(pump(p, g, f)) for p, (g, f) in enumerate(zip(self.gens, self.firsts))]
        try:
            live = len(tasks)
            while live:
                p, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield p * self.n + item.index, item
        finally:
            for t in tasks:
                t.cancel()

    async def close(self) -> None:
        for p in range(len(self.gens)):
            self.runtime.abort(f"{self.request_id}-{p}")  # synchronous: runs even while being cancelled
        for gen in self.gens:
            try:
                await gen.aclose()
            except (RuntimeError, asyncio.CancelledError):  # already running in a cancelled pump task
                pass


def stream_error(e: Exception) -> APIError:
    """An error after the first byte: it can only travel inside the stream."""
    if isinstance(e, APIError):
        return e
    log.exception("error while streaming")
    return APIError(500, f"internal error while streaming ({type(e).__name__}); the server log has details")


ABORTED = "the request was aborted (server shutting down?)"


async def collect(streams, total: int, usage, metrics, model: str):
    """Run every stream to its end (a non-streamed answer): per choice, its text, finish
    reason (None = ran out of tokens) and token logprobs."""
    texts, reasons, lps = [""] * total, [None] * total, [[] for _ in range(total)]
    try:
        async for i, piece in streams:
            texts[i] += piece.text
            lps[i].extend(piece.logprobs or [])
            reasons[i] = piece.finish_reason or reasons[i]
            usage.completion[i] = piece.num_output_tokens
            if metrics:
                metrics.token_piece(model, streams, piece)
    finally:
        await streams.close()
    if "abort" in reasons:
        raise APIError(503, ABORTED, code="aborted")
    if metrics:
        metrics.finished(model, streams)
    return texts, reasons, lps


async def sse_events(
    streams, head: dict, usage, metrics, model: str, include_usage: bool, choice, first=None, token_ids=False
):
    """A streamed answer as SSE chunks: `first` (a list of choices, sent before any piece),
    then `choice(i, piece)` for each piece that carries text, logprobs or a finish reason,
    then the usage chunk (if asked for) and [DONE]. An error after the start travels as an
    error event. token_ids (headwise.token_ids, asked for by a gateway): every piece's ids ride
    along as "headwise": {"token_ids": [...]}, also in pieces whose text is held back."""
    if include_usage:
        head = {**head, "usage": None}

    def chunk(i, piece) -> bytes | None:
        """A piece's chunk (None: it sends nothing), counted; here or in the engine's thread (direct)."""
        usage.completion[i] = piece.num_output_tokens
        if metrics:
            metrics.token_piece(model, streams, piece)
        if piece.finish_reason == "abort":
            raise APIError(503, ABORTED, code="aborted")
        if token_ids and piece.token_ids:
            return sse({**head, "choices": [choice(i, piece)], "headwise": {"token_ids": piece.token_ids}})
        if piece.text or piece.finish_reason or piece.logprobs:
            return sse({**head, "choices": [choice(i, piece)]})
        return None

    try:
        if first:
            yield sse({**head, "choices": first})
        if streams.direct is not None:  # one engine stream of one choice: index 0
            streams.direct.start(lambda piece: chunk(0, piece))
        async for i, piece in streams:
            data = chunk(i, piece)
            if data is not None:
                yield data
        if metrics:
            metrics.finished(model, streams)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage.as_dict()})
        yield SSE_DONE
    except Exception as e:
        yield sse(stream_error(e).body())
        yield SSE_DONE
    finally:
        if streams.direct is not None:
            streams.direct.close()
            if metrics:
                metrics.stream_closed(model, streams.direct)
        await streams.close()


async def until_disconnect(coro, request):
    """Run a non-streaming handler; if the client hangs up first, cancel it (which aborts
    its engine requests) instead of computing an answer nobody reads."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise APIError(499, "client closed the request", code="client_closed")


# ---------------------------------------------------------------- logprobs
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
        tops.append({_token_text(tok, i): lp for i, lp in t.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
