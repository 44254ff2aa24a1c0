"""The collectives a head-parallel model calls, with their cost counted and their failures named.

A sharded model makes two all-reduces a layer (after attention, after the MLP) and, with a
vocabulary-split output head, one all-gather a step. Every rank must make the same calls in
the same order; when one rank dies the others' next call fails (gloo: the peer's socket
closes) or times out (the group's timeout, `init(timeout_s=...)`), and `ParallelError` says
which call on which rank, instead of a bare backend message or a hang.

    comm = init()                      # under torchrun: RANK / WORLD_SIZE / MASTER_ADDR from the env
    shard(model, comm)                 # headwise.parallel.shard
    comm.seconds, comm.calls, comm.bytes   # time spent in collectives so far (benchmarks)
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import Tensor


class ParallelError(RuntimeError):
    """A collective failed: another rank exited, or stopped answering for longer than the timeout."""


class Comm:
    """One process group as a sharded model sees it: rank, world size, all-reduce, all-gather."""

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call headwise.parallel.init() on every rank "
                "(or launch with headwise.parallel.spawn / torchrun) before sharding a model"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.seconds = 0.0  # wall time inside collectives, summed over calls
        self.calls = 0
        self.bytes = 0  # payload bytes handed to collectives (per rank, not on the wire)
        # engine.py's second (gloo) group for the step broadcasts, made on first use, in the same
        # order on every rank
        self.control_group = None

    def reset_stats(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def all_reduce(self, t: Tensor, what: str) -> Tensor:
        """Sum t over the ranks, in place (t must be contiguous); `what` names the call in errors."""
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t, group=self.group)
        except RuntimeError as e:  # DistBackendError, DistNetworkError and gloo's own are RuntimeErrors
            raise self._failed("all-reduce", what, t0, e) from e
        self._count(t0, t)
        return t

    def all_gather_last(self, t: Tensor, sizes: list[int], what: str) -> Tensor:
        """t (..., sizes[rank]) on each rank -> (..., sum(sizes)), the ranks' pieces side by side.
        Pieces may differ in length: each is padded to the longest for the collective."""
        longest = max(sizes)
        if t.shape[-1] != longest:
            t = torch.nn.functional.pad(t, (0, longest - t.shape[-1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        t0 = time.perf_counter()
        try:
            dist.all_gather(parts, t, group=self.group)
        except RuntimeError as e:
            raise self._failed("all-gather", what, t0, e) from e
        self._count(t0, t)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def broadcast_int(self, value: int, src: int = 0) -> int:
        on_gpu = dist.get_backend(self.group) == "nccl"  # NCCL moves CUDA tensors only
        t = torch.tensor([value], dtype=torch.int64, device="cuda" if on_gpu else "cpu")
        t0 = time.perf_counter()
        try:
            dist.broadcast(t, src, group=self.group)
        except RuntimeError as e:
            raise self._failed("broadcast", "an int", t0, e) from e
        return int(t.item())

    def sync_rng(self) -> int:
        """Seed torch's default generator with one number from rank 0 on every rank, so that
        sampling without an explicit seed draws the same tokens everywhere (the logits are the
        same on every rank: each holds the all-reduced sums). Returns the seed."""
        seed = self.broadcast_int(int(torch.randint(0, 2**62, ()).item()) if self.rank == 0 else 0)
        torch.manual_seed(seed)
        return seed

    def _count(self, t0: float, t: Tensor) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += t.numel() * t.element_size()

    def _failed(self, op: str, what: str, t0: float, e: Exception) -> ParallelError:
        waited = time.perf_counter() - t0
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return ParallelError(
            f"rank {self.rank} of {self.world_size}: the {op} of {what} failed after {waited:.1f} s: another "
            f"rank exited or stopped answering ({first}). The ranks of a sharded model run every step "
            f"together, so none can go on: restart all of them"
        )

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={dist.get_backend(self.group)!r})"


def init(backend: str | None = None, *, timeout_s: float = 60.0, init_method: str | None = None, **kwargs) -> Comm:
    """Join (or reuse) the default process group and return its Comm.

    backend: None = NCCL when CUDA is available, else gloo. Rank, world size and the rendezvous
    come from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless
    init_method / rank= / world_size= are given. timeout_s: how long a collective waits for a
    silent rank before failing (a rank that exits is noticed at once by gloo).
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if init_method is None and "RANK" not in os.environ and "rank" not in kwargs:
            raise RuntimeError(
                "no rank given: run under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
                "use headwise.parallel.spawn for processes on this machine, or pass init_method, rank= "
                "and world_size="
            )
        dist.init_process_group(
            backend, init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return Comm()
