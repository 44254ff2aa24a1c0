"""How an `Engine`'s requests get run: generate() (an offline batch, stepped in the caller's thread
unless the engine thread runs), stream() (an async generator per request) and the background
thread that steps while there is work (start/shutdown, and `_fail` when a step raises).

`Frontends` is a base of `Engine` (engine.py), which holds the requests, the lock, the outbox
and step(); these methods only use those.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from ..runtime.request import RequestOutput, Status, StreamPiece
from ..runtime.sampling import SamplingParams

# After a step that handed pieces to async streams, the stepping thread waits up to this long for
# their event loop to take them before it starts the next step. The loop's work per piece (its
# stream, SSE, HTTP; ~0.2 ms of Python) then runs on the core the step leaves idle, with the GIL to
# itself, instead of inside the next step, where it holds the GIL against the step's Python and
# takes a core from the kernel's OpenMP team: one client through `headwise serve` decoded at
# 0.81-0.88x generate() without the wait and 0.82-0.95x with it (paired medians of 5 rounds,
# benchmarks/serving.py, AMD EPYC Zen 5; five runs each way, medians 0.85x and 0.91x).
# Only when a step fed a few streams: with many, the step is long and compute-bound, and their
# loop's work (~0.2 ms each) would outgrow the wait. A stream whose pieces the stepping thread
# writes itself (stream(direct=...), serve/direct.py) hands its reader only the first and last.
READER_WAIT_S = 0.002
READER_WAIT_STREAMS = 4


class Frontends:
    """generate(), stream() and the stepping thread of `Engine` (see there for the state they use)."""

    # ------------------------------------------------------------------ offline batch
    def generate(self, prompts, sampling=None, *, progress: bool = False) -> list[RequestOutput]:
        """Run a batch of prompts to completion, all scheduled together; one RequestOutput per prompt,
        in order. sampling: one SamplingParams for all, or a list with one per prompt. The queue
        limits do not apply. Steps in this thread unless the engine thread is running."""
        ids, _ = self.output.prompts(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(ids):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(ids)} prompts")
            params = list(sampling)
        else:
            params = [sampling] * len(ids)
        groups, share = [], uuid.uuid4().hex  # one call is one share of the engine (runtime/fair.py)
        try:
            for p, s in zip(ids, params):
                groups.append(self._add(p, s, None, None, limits=False, share=share))
            t0, shown = time.perf_counter(), 0.0
            for g in groups:
                while not g.done.is_set():
                    if self._thread is not None and self._thread.is_alive():
                        g.done.wait(0.5)
                    else:
                        self._check_alive()
                        self.step()
                    if g.error is not None:
                        raise RuntimeError("the engine failed during generate()") from g.error
                    if progress and time.perf_counter() - shown > 1.0:
                        shown = time.perf_counter()
                        done = sum(x.done.is_set() for x in groups)
                        toks = sum(c.num_output_tokens for x in groups for c in x.children)
                        print(
                            f"[engine] {done}/{len(groups)} requests, {toks} tokens, {toks / (shown - t0):.1f} tok/s",
                            file=sys.stderr,
                            flush=True,
                        )
        except BaseException:
            for g in groups:
                self.abort(g.request_id)
            raise
        return [g.output() for g in groups]

    # ------------------------------------------------------------------ streaming
    async def stream(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume=None,
        direct: Callable[[StreamPiece], bool] | None = None,
        priority: int = 0,
        client: str | None = None,
        share: str | None = None,
    ) -> AsyncIterator[StreamPiece]:
        """Stream one request's pieces (async generator). Validates and queues at the first
        __anext__ (QueueFull / ValueError raise there) and starts the engine thread if needed.
        Closing the generator early (a client that went away) aborts the request and frees
        its blocks at once. resume (runtime.output.Resume): continue a completion that
        another server began (the gateway's failover); max_new_tokens counts the new tokens.

        direct(piece) -> bool: a consumer that can take a piece in the stepping thread itself
        (serve/direct.py writes its SSE chunk to the client's socket). It is offered a piece
        that does not end the stream only while the reader has passed every earlier piece
        through its consumer (so order holds); True: taken, the reader never sees it.
        priority, client, share: the request's fair share of the engine (see add_request)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        idle = threading.Event()

        def sink(item) -> bool:
            """-> True when the piece went to the reader (False: `direct` took it). Called by one
            deliverer at a time (Engine._flush)."""
            if (
                direct is not None
                and group.taken == group.handed
                and isinstance(item, StreamPiece)
                and item.finish_reason is None
                and direct(item)
            ):
                return False
            group.handed += 1
            idle.clear()
            loop.call_soon_threadsafe(queue.put_nowait, item)
            return True

        fair = dict(priority=priority, client=client, share=share)
        group = self._add(self._one_prompt(prompt), sampling, request_id, sink, limits=True, resume=resume, **fair)
        group.keep_output = False  # its reader has every piece: nothing to keep for result()
        group.reader_idle = idle
        done, got = False, 0
        try:
            self.start()
            left = group.params.n
            while left:
                group.taken = got  # back for more: the pieces so far are through the reader's consumer
                if queue.empty():
                    idle.set()
                item = await queue.get()
                got += 1
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed while running {group.request_id!r}") from item
                left -= item.finish_reason is not None
                yield item
            done = True
        finally:
            idle.set()  # nothing more to take
            if not done:
                self.abort(group.request_id)

    # ------------------------------------------------------------------ the thread
    def start(self) -> "Frontends":
        """Start the background thread that steps while there is work (idempotent)."""
        with self._lock:
            self._check_alive()
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="headwise-engine", daemon=True)
                self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.scheduler.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it
                self._fail(e)
                return
            self._await_readers()

    def _await_readers(self) -> None:
        """Wait (READER_WAIT_S at most, all streams together) until the streams handed pieces in
        the last step (READER_WAIT_STREAMS at most) have taken them. A reader still behind on an
        earlier step's pieces (a client not reading, a loop that was busy) is not waited for until
        it has caught up: a stalled client costs the others one wait, not one per step."""
        groups, self._fed = list(self._fed.values()), {}  # (a concurrent abort's flush may add or not)
        wait = len(groups) <= READER_WAIT_STREAMS
        end = time.perf_counter() + READER_WAIT_S
        for g in groups:
            idle, behind, g.mark = g.reader_idle, g.taken < g.mark, g.handed
            if not wait or idle is None or behind or idle.is_set():
                continue
            left = end - time.perf_counter()
            if left > 0:
                idle.wait(left)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            for group in list(self._groups.values()):
                group.error = error
                for r in group.children:
                    if r.status is not Status.FINISHED:
                        self.core.finish(r, "abort")
                self._outbox.append((group, error))
                self._close(group)
        self._flush()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (after the step in flight) and abort every unfinished request."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.abort_all()

    def __enter__(self) -> "Frontends":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
