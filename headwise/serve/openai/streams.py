"""Running a request's engine streams: several prompts merged into one stream of choices, usage,
the SSE chunks of a streamed answer (the engine's thread may write them itself: serve/direct.py),
and cancelling work whose client went away.

Nothing is sent to the client before the first piece of every stream has arrived,
so overload (429), bad input (400) and timeouts are still proper HTTP errors that
the gateway may retry elsewhere; after that, an error travels inside the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import struct
import time
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from ..errors import APIError
from ..middleware import sent_key
from ..timeouts import CONNECTION_KEY
from .common import SSE_DONE, sse

log = logging.getLogger("headwise.serve")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated
    resumed: int = 0  # tokens another server generated before this one resumed (headwise.resume)
    predicted: bool = False  # the request sent a prediction: usage says what became of it, as OpenAI's
    prediction: dict[int, tuple[int, int]] = field(default_factory=dict)  # choice -> (accepted, rejected)

    def take(self, i: int, piece) -> None:
        """Choice i's counts as of this piece (each piece carries the totals so far)."""
        self.completion[i] = piece.num_output_tokens
        if self.predicted:
            self.prediction[i] = (piece.accepted_prediction_tokens, piece.rejected_prediction_tokens)

    def as_dict(self) -> dict:
        c = sum(self.completion.values()) + self.resumed
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": c, "total_tokens": self.prompt_tokens + c}
        if self.predicted:
            accepted, rejected = (sum(x) for x in zip((0, 0), *self.prediction.values()))
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected,
            }
        return out


class Streams:
    """The engine streams of one API request (one per prompt; each carries n choices).

    `await start(...)` enqueues every prompt and waits for each first piece; then
    `async for choice, piece in streams` yields pieces as they come, with the global
    choice index (prompt * n + piece.index). `close()` aborts whatever still runs.
    fair: the request's priority and client (fair_share); its prompts are one share of the engine.
    """

    def __init__(self, runtime, request_id: str, n: int, fair: dict | None = None):
        self.runtime, self.request_id, self.n = runtime, request_id, n
        self.fair = {**(fair or {}), "share": request_id}
        self.gens: list = []
        self.firsts: list = []
        self.t_start = time.perf_counter()
        self.direct = None  # serve/direct.py's writer, when one engine stream of one choice takes it

    async def start(self, prompts: list[list[int]], sampling, timeout: float | None, resume=None, direct=None) -> None:
        """direct: a DirectWriter (streamed answers): used when there is one prompt and n = 1."""
        if direct is not None and len(prompts) == 1 and self.n == 1:
            self.direct = direct
        try:
            async with asyncio.timeout(timeout):
                for p, ids in enumerate(prompts):
                    rid = f"{self.request_id}-{p}"
                    gen = self.runtime.stream(
                        ids, sampling, request_id=rid, resume=resume, direct=self.direct, **self.fair
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


def fair_share(request, priority: int = 0) -> dict:
    """An API request's place in the engine's fair shares (runtime/fair.py): its priority, and its
    client: the API key it sent (middleware.sent_key), hashed -- the key itself is
    never kept; None without one (the request is a client of its own)."""
    key = sent_key(dict(request.scope.get("headers") or []))  # the key ApiKeyAuth checked
    client = "key-" + hashlib.sha256(key).hexdigest()[:16] if key else None
    return {"priority": priority, "client": client}


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
            usage.take(i, piece)
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
    then `choice(i, piece)` for each piece that carries text, logprobs or a finish reason (a list
    of choices: one chunk each, the first with the piece's logprobs; [] sends nothing),
    then the usage chunk (if asked for) and [DONE]. An error after the start travels as an
    error event. token_ids (headwise.token_ids, asked for by a gateway): every piece's ids ride
    along as "headwise": {"token_ids": [...]}, also in pieces whose text is held back."""
    if include_usage:
        head = {**head, "usage": None}

    def chunk(i, piece) -> bytes | None:
        """A piece's chunk (None: it sends nothing), counted; here or in the engine's thread (direct)."""
        usage.take(i, piece)
        if metrics:
            metrics.token_piece(model, streams, piece)
        if piece.finish_reason == "abort":
            raise APIError(503, ABORTED, code="aborted")
        made = choice(i, piece)
        if isinstance(made, list):  # several chunks for one piece (tool-call deltas), or none (held back)
            if not made and token_ids and piece.token_ids:  # the ids travel even while text is held back
                made = [{"index": i, "delta": {}, "logprobs": None, "finish_reason": None}]
            if not made:
                return None
            extra = {"headwise": {"token_ids": piece.token_ids}} if token_ids and piece.token_ids else {}
            return b"".join(sse({**head, "choices": [c], **(extra if k == 0 else {})}) for k, c in enumerate(made))
        if token_ids and piece.token_ids:
            return sse({**head, "choices": [made], "headwise": {"token_ids": piece.token_ids}})
        if piece.text or piece.finish_reason or piece.logprobs:
            return sse({**head, "choices": [made]})
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


# ---------------------------------------------------------------- clients that stop reading
# Four clients that stopped reading their streams kept generating to max_tokens, holding 1,148 of
# 1,456 KV blocks for 400 s while 6.4 MB sat in send queues (issue 43): the kernel grows a
# loopback socket's send buffer to ~1.7 MB before asyncio's transport even pauses.
STALL_TIMEOUT = 30.0  # [server] stall_timeout: seconds a stream's client may leave it undrained
# What a stream may hold unsent: a token's chunk is ~0.2-2 KB and a reading client takes it within a
# round trip, so 32 + 16 KiB cost it nothing, while a silent one fills them within ~100-300 tokens
# (the stall clock starts then: 4 silent SmolLM2 streams were freed 41 s after they stopped reading
# with 128 KiB, the stall at 5 s, on a loaded 2-core machine)
STREAM_SNDBUF = 16 * 1024  # SO_SNDBUF of a streaming connection (Linux doubles it: 32 KiB held)
STREAM_HIGH_WATER = 16 * 1024  # the transport's buffer, beyond which a send waits (asyncio's default: 64 KiB)


class EventStream(StreamingResponse):
    """An SSE response whose client must keep reading: what one stream may hold unsent is bounded
    (while it streams, the socket's send buffer is STREAM_SNDBUF and the transport's high-water mark
    STREAM_HIGH_WATER, beyond which sending waits), and a send that waits longer than the stall
    timeout ends the stream: the body iterator is closed (which aborts its engine requests and
    frees their KV blocks) and the connection reset. Tokens are a few KB a second, so the smaller
    buffer costs a reading client nothing; pieces generated during the wait stay in the engine's
    queue (stall timeout x token rate, at most)."""

    def __init__(self, content, request, headers: dict | None = None):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.stall = stall_timeout(request)
        self.transport = (request.scope.get("extensions") or {}).get(CONNECTION_KEY)
        self.client = request.client

    async def stream_response(self, send) -> None:
        async def bounded(message) -> None:
            try:
                async with asyncio.timeout(self.stall):
                    await send(message)  # uvicorn waits here while the transport is paused
            except TimeoutError:
                raise _Stalled from None

        restore = _small_send_buffer(self.transport)
        try:
            await super().stream_response(bounded)
        except _Stalled:
            log.warning(
                "closing a stream to %s: it read nothing for %g s ([server] stall_timeout); its request is aborted",
                "%s:%d" % tuple(self.client) if self.client else "a client",
                self.stall,
            )
            await self.body_iterator.aclose()  # the generators' finally: engine requests aborted
            _reset(self.transport)
            await asyncio.sleep(0)  # uvicorn sees the connection lost before the app returns
        finally:
            restore()


class _Stalled(Exception):
    pass


def stall_timeout(request) -> float:
    state = getattr(request.app.state, "serve", None) if "app" in request.scope else None
    server = getattr(getattr(state, "config", None), "server", None)
    return float(getattr(server, "stall_timeout", STALL_TIMEOUT))


def _sock(transport):
    return None if transport is None or transport.is_closing() else transport.get_extra_info("socket")


def _small_send_buffer(transport):
    """The connection's send buffers at STREAM_SNDBUF / STREAM_HIGH_WATER while it streams; -> what
    puts the old sizes back."""
    sock = _sock(transport)
    try:
        old = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
        limits = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=STREAM_HIGH_WATER)
    except (AttributeError, OSError):  # no socket (not our protocol, closed): the stall clock still holds
        return lambda: None

    def restore() -> None:
        s = _sock(transport)
        if s is not None:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, old // 2)  # getsockopt reports it doubled
                transport.set_write_buffer_limits(high=limits[1], low=limits[0])
            except OSError:
                pass

    return restore


def _reset(transport) -> None:
    """Close at once, dropping what waits unsent (an RST: a plain close would leave the kernel
    holding the bytes for a client that reads nothing); without the transport uvicorn closes it."""
    sock = _sock(transport)
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    transport.abort()


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
