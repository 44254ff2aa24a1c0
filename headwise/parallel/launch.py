"""Run a function on N local processes joined in one process group: `spawn(fn, N, *args)`.

torchrun does this (and multi-node rendezvous) from the command line; `spawn` is the same
for code and tests on one machine: each child takes its share of the cores (cores // N torch
threads, fitted below that as other processes' load changes: runtime/threads.py), joins a gloo group
through a file store (no port to pick, none to collide), calls fn(comm, *args) and sends
back what it returned. A rank that raises, or exits without answering, is reported with
its rank and error; the others are not left hanging (their collectives fail with
ParallelError, see comm.py) and any still running at the deadline are killed.

    logits = spawn(run_rank, 3, "smollm2-135m-instruct")   # [rank 0's result, rank 1's, rank 2's]

`RankGroup` is the long-lived variant for a process that stays rank 0 (a server): ranks
1..N-1 start as above and run fn(comm, *args) for as long as it takes; this process joins
as rank 0, and can ask at any time whether a follower failed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None  # fn's return value when ok
    error: str = ""  # the exception (type: message) when not ok
    traceback: str = ""
    seconds: float = 0.0  # from the child's start to its answer


class RanksFailed(RuntimeError):
    """At least one rank did not return; `outcomes` has every rank's result or error."""

    def __init__(self, outcomes: list[RankOutcome]):
        self.outcomes = outcomes
        bad = [o for o in outcomes if not o.ok]
        lines = [f"rank {o.rank}: {o.error}{_where(o.traceback)}" for o in bad]
        super().__init__(f"{len(bad)} of {len(outcomes)} ranks failed:\n  " + "\n  ".join(lines))


# Ranks fork from a server process that has imported these and done nothing else: a rank starts
# in milliseconds instead of re-importing torch (~2 s of CPU each), and no OpenMP pool or lock
# was ever used before the fork (the reason not to fork from the caller, which may have).
PRELOAD = ["headwise.parallel.launch", "torch.distributed", "headwise.models", "headwise.generation", "headwise.cache"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")  # a fresh interpreter per rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # effective when the server starts (the first spawn)
    return ctx


def _where(tb: str) -> str:
    """' (at file:line)' of the innermost frame of a traceback, or ''."""
    frames = [line.strip() for line in tb.splitlines() if line.strip().startswith("File ")]
    return f" ({frames[-1]})" if frames else ""


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "gloo",
    threads: int | None = None,
    timeout_s: float = 30.0,
    deadline_s: float = 300.0,
    raise_on_failure: bool = True,
) -> list:
    """fn(comm, *args) on `world_size` new processes -> the list of their return values by rank.

    fn must be importable by name (a module-level function) and its arguments and result
    picklable (ranks start from a fork server, see PRELOAD). threads: the most torch threads a rank
    runs, set before fn runs; None (the default) and more than its share (cores // world_size) take
    the share: ranks never oversubscribe the cores. HEADWISE_THREADS pins every rank. timeout_s: the process
    group's timeout, how long a collective waits for a silent rank. deadline_s: the whole
    run's limit, after which ranks still running are killed. raise_on_failure=False returns
    the RankOutcome of every rank instead of raising RanksFailed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _context()
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="headwise-tp-") as tmp:
        store = "file://" + os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, rank, world_size, store, backend, threads, timeout_s, args, answers),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes = _collect(procs, answers, time.monotonic() + deadline_s)
    if raise_on_failure:
        if not all(o.ok for o in outcomes):
            raise RanksFailed(outcomes)
        return [o.value for o in outcomes]
    return outcomes


def _collect(procs, answers, deadline: float) -> list[RankOutcome]:
    got: dict[int, RankOutcome] = {}
    gone_at: dict[int, float] = {}
    while len(got) < len(procs):
        try:
            rank, payload = answers.get(timeout=0.05)
            got[rank] = pickle.loads(payload)
            continue
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank in got or p.is_alive():
                continue
            # exited without an answer (or its answer is still in the pipe): give the pipe a moment
            if now - gone_at.setdefault(rank, now) > 1.0:
                got[rank] = RankOutcome(rank, False, error=f"exited with code {p.exitcode} before answering")
        if now > deadline:
            for rank, p in enumerate(procs):
                if rank not in got:
                    p.kill()
                    got[rank] = RankOutcome(rank, False, error="still running at the deadline; killed")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return [got[r] for r in range(len(procs))]


class RankGroup:
    """`spawn` for a process that leads while it runs: ranks 1..N-1 start as local processes running
    fn(comm, *args) (same rules as spawn's fn); this process joins the group as rank 0.

        group = RankGroup(follow_fn, 2, spec)   # returns once every rank has joined
        shard(model, group.comm)                # rank 0's part runs here
        group.failure()                         # None, or which follower failed and how
        group.close()                           # their outcomes; any still running is killed

    A follower that raises, exits or is killed shows in failure() (wait_failure() blocks until
    one exits: a watchdog thread's call); rank 0's next collective with it fails with
    ParallelError (comm.py). A follower that is alive but silent shows only there, after the
    group's timeout. One group per process: torch.distributed's default group is this one's.
    """

    def __init__(
        self,
        fn: Callable,
        world_size: int,
        *args,
        backend: str = "gloo",
        threads: int | None = None,
        timeout_s: float = 60.0,
    ):
        import torch.distributed as dist

        from .comm import init

        if world_size < 2:
            raise ValueError(f"world_size={world_size}: a RankGroup is rank 0 here and at least one follower")
        if dist.is_initialized():
            raise RuntimeError(
                "this process is in a torch.distributed group already (torchrun, or a RankGroup not "
                "closed yet); it can lead one group at a time"
            )
        ctx = _context()
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="headwise-tp-")
        store = "file://" + os.path.join(self._tmp.name, "store")
        self._answers = ctx.Queue()
        self._outcomes: dict[int, RankOutcome] = {}
        self._closing = False
        # multiprocessing's forkserver Popen reads a child's exit status off a pipe once; two threads
        # asking at once (the watchdog's failure() and a step's) make the second read EOF, which it
        # reports as exit code 255 (and may store over the first's). Every status read holds this.
        self._status_lock = threading.RLock()
        self.procs = {
            rank: ctx.Process(
                target=_child,
                args=(fn, rank, world_size, store, backend, threads, timeout_s, args, self._answers),
                daemon=True,  # ended with this process if it exits without close()
                name=f"headwise-rank-{rank}",
            )
            for rank in range(1, world_size)
        }
        try:
            for p in self.procs.values():
                p.start()
            self.comm = init(backend, timeout_s=timeout_s, init_method=store, rank=0, world_size=world_size)
        except BaseException as e:
            why = self.failure(wait_s=1.0)
            self.close(timeout=0)
            if why is not None:
                raise RuntimeError(f"the ranks did not start: {why}") from e
            raise

    def pids(self) -> dict[int, int]:
        """{rank: process id} of the followers."""
        return {rank: p.pid for rank, p in self.procs.items()}

    def _drain(self, wait_s: float = 0.0) -> None:
        """Take the answers in the pipe (waiting up to wait_s for the first)."""
        while True:
            try:
                rank, payload = self._answers.get(timeout=wait_s) if wait_s > 0 else self._answers.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):  # OSError / ValueError: the queue is closed
                return
            self._outcomes[rank] = pickle.loads(payload)
            wait_s = 0.0

    def failure(self, wait_s: float = 0.5) -> str | None:
        """Which follower failed and how ("rank 1 of 2 was killed by SIGKILL", "rank 1 of 2 failed:
        ValueError: ..."), or None while every one runs. wait_s: how long to wait for the answer of a
        follower that exited with code 0 (it wrote one before exiting); never blocks otherwise.
        Safe to call from several threads at once."""
        with self._status_lock:
            return self._failure(wait_s)

    def _failure(self, wait_s: float) -> str | None:
        self._drain()
        for rank, p in self.procs.items():
            if rank not in self._outcomes and not p.is_alive() and p.exitcode == 0:
                self._drain(wait_s)
            out = self._outcomes.get(rank)
            where = f"rank {rank} of {self.world_size}"
            if out is not None and not out.ok:
                return f"{where} failed: {out.error}{_where(out.traceback)}"
            if out is not None and not self._closing:
                return f"{where} returned before the group was closed"
            if out is None and not p.is_alive() and p.exitcode is not None:
                code = p.exitcode
                return (
                    f"{where} was killed by {signal.Signals(-code).name}"
                    if code < 0
                    else f"{where} exited with code {code}"
                )
        return None

    def wait_failure(self) -> str | None:
        """Block until a follower exits; -> failure() then, or None once close() has begun."""
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.procs.values()])
        return None if self._closing else self.failure()

    def close(self, timeout: float = 10.0) -> list[RankOutcome]:
        """Wait up to `timeout` s for the followers to exit (their fn returned: e.g. follow() after
        release()), kill the rest, leave the process group; -> the followers' outcomes, by rank."""
        self._closing = True
        with self._status_lock:
            return self._close(timeout)

    def _close(self, timeout: float) -> list[RankOutcome]:
        import torch.distributed as dist

        started = {rank: p for rank, p in self.procs.items() if p.pid is not None}
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in started.values()) and time.monotonic() < deadline:
            self._drain(0.05)  # read while they exit: a child flushes its answer into the pipe first
        killed = {rank for rank, p in started.items() if p.is_alive()}
        for rank in killed:
            started[rank].kill()
        for p in started.values():
            p.join(timeout=5)
        self._drain()
        outcomes = []
        for rank, p in self.procs.items():
            why = (
                "still running at close(); killed"
                if rank in killed
                else "never started"
                if rank not in started
                else f"exited with code {p.exitcode} before answering"
            )
            outcomes.append(self._outcomes.get(rank) or RankOutcome(rank, False, error=why))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        self._answers.close()
        self._tmp.cleanup()
        return outcomes


def _child(fn, rank, world_size, store, backend, threads, timeout_s, args, answers) -> None:
    t0 = time.perf_counter()
    from ..runtime.threads import start_rank

    start_rank(world_size, threads)  # in this, the thread that runs fn's ops
    from .comm import init

    try:
        comm = init(backend, timeout_s=timeout_s, init_method=store, rank=rank, world_size=world_size)
        value = fn(comm, *args)
        out = RankOutcome(rank, True, value=value, seconds=time.perf_counter() - t0)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, named
        out = RankOutcome(
            rank,
            False,
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc(),
            seconds=time.perf_counter() - t0,
        )
    answers.put((rank, pickle.dumps(out)))
    answers.close()
    answers.join_thread()  # the answer is in the pipe before the process exits
    import torch.distributed as dist

    if out.ok and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass
