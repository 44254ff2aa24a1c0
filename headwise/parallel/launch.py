"""Run a function on N local processes joined in one process group: `spawn(fn, N, *args)`.

torchrun does this (and multi-node rendezvous) from the command line; `spawn` is the same
for code and tests on one machine: each child sets its thread count, joins a gloo group
through a file store (no port to pick, none to collide), calls fn(comm, *args) and sends
back what it returned. A rank that raises, or exits without answering, is reported with
its rank and error; the others are not left hanging (their collectives fail with
ParallelError, see comm.py) and any still running at the deadline are killed.

    logits = spawn(run_rank, 3, "smollm2-135m-instruct")   # [rank 0's result, rank 1's, rank 2's]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import tempfile
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
    threads: int = 1,
    timeout_s: float = 30.0,
    deadline_s: float = 300.0,
    raise_on_failure: bool = True,
) -> list:
    """fn(comm, *args) on `world_size` new processes -> the list of their return values by rank.

    fn must be importable by name (a module-level function) and its arguments and result
    picklable (ranks start from a fork server, see PRELOAD). threads: torch threads per rank (set before fn runs). timeout_s: the process
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


def _child(fn, rank, world_size, store, backend, threads, timeout_s, args, answers) -> None:
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
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
