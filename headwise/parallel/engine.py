"""The engine over a sharded model: rank 0 schedules, every rank runs each step.

    if comm.rank == 0:
        engine = lead(model, comm, config)     # a headwise.Engine: generate, stream, serve as usual
        ...
        release(engine)                        # the followers' follow() returns
    else:
        follow(model, comm, config)            # runs rank 0's steps until release

Rank 0 is the whole engine (front end, scheduler, sampler). The followers hold only a KV
pool of their heads, built from the same EngineConfig, and mirror rank 0's pool: every call
that changes which block holds what (add_sequence with its prefix sharing, fork, free,
packed with its reservations and copy-on-write copies, a step's commit) is recorded on rank 0
and replayed, in the same order, by each follower just before the forward it precedes; the
pool's allocation is deterministic, so every rank's block tables agree and each rank writes
its heads' K/V into the same slots. Before each forward rank 0 broadcasts that log and the
step's input_ids on a control group with a long timeout (an idle engine waits for requests);
the forward's own all-reduces then run on the model's group as in generate().
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist
from torch import nn

from ..engine import Engine, EngineConfig
from ..runtime.paged import EngineCore
from ..runtime.threads import fit_threads
from .comm import Comm, ParallelError

IDLE_TIMEOUT = datetime.timedelta(days=7)  # the control group's: followers wait this long for a step


def _control(comm: Comm):
    """A second gloo group for the step broadcasts (made once, in the same order on every rank)."""
    if comm.control_group is None:
        comm.control_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return comm.control_group


def _broadcast(comm: Comm, message=None):
    box = [message]
    try:
        dist.broadcast_object_list(box, src=0, group=_control(comm))
    except RuntimeError as e:
        raise ParallelError(
            f"rank {comm.rank} of {comm.world_size}: the engine's step broadcast failed: rank 0 or a "
            f"follower exited ({str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}); "
            "restart all ranks"
        ) from e
    return box[0]


class _PoolLog:
    """Rank 0's pool's journal (PagedKVCache.journal): each call that changed block ownership,
    its arguments as plain ints, for the followers to replay; and the last packed step, the one
    the next forward must run."""

    def __init__(self):
        self._ops: list = []
        self._lock = threading.Lock()  # the engine's thread appends while the forward takes
        self.last_step = None

    def __call__(self, op: str, *args, **kwargs) -> None:
        if op == "add_sequence":
            seq_id, token_ids = args
            args = (seq_id, None if token_ids is None else [int(t) for t in token_ids])
        elif op == "packed":
            step, seq_ids, num_new, token_ids = args
            news = None if token_ids is None else [None if t is None else [int(x) for x in t] for t in token_ids]
            args = (list(seq_ids), num_new if isinstance(num_new, int) else list(num_new), news)
            self.last_step = step
        with self._lock:
            self._ops.append((op, args, kwargs))

    def take(self) -> list:
        with self._lock:
            ops, self._ops = self._ops, []
        return ops


class _Leader(nn.Module):
    """Rank 0's model as the engine sees it: before each forward, the step goes to the followers."""

    def __init__(self, model: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = model, comm
        self.config, self.tokenizer = model.config, getattr(model, "tokenizer", None)
        self.log: _PoolLog | None = None  # set by lead() once the engine has made its pool

    def forward(self, input_ids, step=None, **kwargs):
        if self.log is None or step is not self.log.last_step or kwargs:
            raise ValueError("a sharded engine's model runs only the engine's packed steps")
        _broadcast(self.comm, ("step", self.log.take(), input_ids.cpu()))  # the control group is gloo
        return self.inner(input_ids, step)


def _config(config: EngineConfig | None, limits: dict) -> EngineConfig:
    config = config if config is not None else EngineConfig()
    return config.replace(**limits) if limits else config


def lead(model: nn.Module, comm: Comm, config: EngineConfig | None = None, **limits) -> Engine:
    """On rank 0: an Engine over the sharded `model` whose every step the followers run too.
    The followers must call follow() with the same config."""
    if comm.rank != 0:
        raise ValueError(f"lead() runs on rank 0; rank {comm.rank} calls follow()")
    leader = _Leader(model, comm)
    engine = Engine(leader, _config(config, limits))
    cache = engine.core.cache
    leader.log = cache.journal = _PoolLog()
    _broadcast(comm, ("hello", cache.num_blocks, cache.block_size))
    return engine


def release(engine: Engine) -> None:
    """On rank 0, when done: stop the background thread and let the followers' follow() return."""
    engine.shutdown()
    _broadcast(engine.model.comm, ("stop",))


def follow(model: nn.Module, comm: Comm, config: EngineConfig | None = None, **limits) -> int:
    """On ranks > 0: run rank 0's engine steps on this rank's heads until release(); returns how many."""
    if comm.rank == 0:
        raise ValueError("rank 0 calls lead(), the other ranks follow()")
    config = _config(config, limits)
    hello = _broadcast(comm)  # ("hello", rank 0's num_blocks, block_size)
    if hello[2] != config.block_size or config.num_blocks not in (None, hello[1]):
        raise ValueError(
            f"rank 0's KV pool has {hello[1]} blocks of {hello[2]} tokens, rank {comm.rank}'s config asks for "
            f"{config.num_blocks} of {config.block_size}: pass every rank the same EngineConfig"
        )
    # unset num_blocks is sized from the memory free when the pool is made, which differs between
    # processes: take rank 0's count, so every rank's pool (of its own heads) has the same blocks
    cache = EngineCore(model, config.replace(num_blocks=hello[1])).cache
    step, steps, device = None, 0, next(model.parameters()).device
    while True:
        message = _broadcast(comm)
        if message[0] == "stop":
            return steps
        _, log, input_ids = message
        for op, args, kwargs in log:
            if op == "packed":
                step = cache.packed(*args, **kwargs)
            elif op == "commit":
                step.commit()
            else:
                getattr(cache, op)(*args, **kwargs)
        fit_threads()  # this rank's share of the cores, fitted to what else runs (runtime/threads.py)
        with torch.inference_mode():
            model(input_ids.to(device), step)  # its logits are rank 0's too; rank 0 samples
        steps += 1
