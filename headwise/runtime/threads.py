"""The process's thread governor, bound to torch: `fit_threads()` before each step (core.py).

core/governor.py has the rule (threads = cores - round(busy cores of other processes), pinned by
HEADWISE_THREADS) and why; this module holds the one instance every step of this process uses,
so a generate() and an engine in one process count each other as theirs, not as a neighbour's.

    from headwise.runtime.threads import pin_threads
    pin_threads(2)      # every step from now runs 2 threads, whatever else runs; pin_threads(None) governs again
"""

from __future__ import annotations

import torch

from ..core.governor import ThreadGovernor, this_machine


def _governor() -> ThreadGovernor:
    meter, default, ceiling = this_machine()
    return ThreadGovernor(torch.get_num_threads, torch.set_num_threads, meter, default=default, ceiling=ceiling)


GOVERNOR = _governor()
fit_threads = GOVERNOR.fit


def pin_threads(n: int | None) -> None:
    """Run every step with n torch threads from now on (as HEADWISE_THREADS=n); None governs again."""
    GOVERNOR.pin(n)


def start_rank(world_size: int, threads: int | None = None) -> int:
    """In a tensor-parallel rank's new process: its share of the cores (cores // world_size, at
    least 1), or `threads` where that is fewer, fitted below that from now on. -> the count set."""
    share = max(1, GOVERNOR.ceiling // world_size)
    return GOVERNOR.restart(min(threads, share) if threads is not None else share)
