"""OpenMP threads spin briefly, then sleep, so headwise decodes well alone and on a shared machine.
(How many threads run, fitted to the cores other processes leave: core/governor.py.)

PyTorch's CPU ops, MKL, oneDNN and our C kernel (headwise/kernels) all run on one OpenMP
runtime (torch's libgomp). Between two parallel regions its worker threads wait: by default
libgomp spins GOMP_SPINCOUNT=300000 rounds (~3 ms) before it sleeps; OMP_WAIT_POLICY=ACTIVE
spins for minutes; OMP_WAIT_POLICY=PASSIVE (0 rounds) sleeps at once. A decode step is
hundreds of short parallel regions a few microseconds apart, so:
- spinning 3 ms keeps the workers busy nearly all the time; when another process wants a
  core, the spinning threads and that process take turns, and each region waits a scheduler
  slice for a worker that was descheduled: 3.4x slower with one busy process on 2 cores;
- sleeping at once pays a futex wake-up per region: ~40% slower on a quiet machine;
- DEFAULT_SPINCOUNT rounds (~20 us here) bridge the gaps inside a step and sleep between
  tokens: as fast as spinning alone, about the fair-share 2x with one busy process
  (benchmarks/busy.py, results/busy.txt: the figures on AMD EPYC, AVX2).

`headwise serve` also sets OMP_WAIT_POLICY=ACTIVE (THREADED_ENV). Without a policy, libgomp
cuts any count to 1,000 rounds ("throttled") once it manages more threads than there are
cores, and it does as soon as a second Python thread runs torch ops (each thread gets its own
team: the server's engine thread beside the main thread that loaded the model): 1,000 rounds
sleep inside a decode step, and one client served decoded at 0.71x `generate()`'s speed.
ACTIVE with an explicit count keeps the count in both cases (0.89-0.93x). It is not the
default for everything: on the main thread alone it made `generate()` ~6% slower here
(46 vs 49 ms a token, interleaved runs; AMD EPYC Zen 3, AVX2).

libgomp reads its environment once, when it is loaded, i.e. when torch is imported. So
`import headwise` sets DEFAULT_ENV if no OpenMP runtime is loaded yet
and neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set (a value you set wins:
OMP_WAIT_POLICY=PASSIVE suits a machine shared with many busy processes). If torch was
imported first it is too late to change from Python, and headwise says so once, with the fix.
"""

from __future__ import annotations

import os
import warnings

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one sets how libgomp's threads wait
# Spin rounds before a worker sleeps. Measured on a 2-core AMD EPYC (benchmarks/busy.py): 1,000
# rounds still sleep inside a decode step (quiet-machine speed of PASSIVE), 2,000 bridge it (the
# speed of spinning), 5,000+ keep spinning into the next token and collapse with a busy neighbour.
DEFAULT_SPINCOUNT = "2000"
DEFAULT_ENV = {"GOMP_SPINCOUNT": DEFAULT_SPINCOUNT}
# Added for a process that runs torch ops in several threads (headwise serve): the count then
# holds when libgomp runs more threads than cores (see above).
THREADED_ENV = {"OMP_WAIT_POLICY": "ACTIVE"}


class ThreadWaitWarning(RuntimeWarning):
    """OpenMP was loaded before headwise with libgomp's spinning waits."""


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux /proc/self/maps; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}


def openmp_loaded() -> bool:
    """True when an OpenMP runtime has already read the environment (torch or another library
    imported it). Without /proc, torch in sys.modules is the best sign."""
    import sys

    return bool(openmp_runtimes()) or "torch" in sys.modules


_warned = False


_ours = False  # whether the policy variables in os.environ are the ones this module set


def configure_wait_policy(threaded: bool = False) -> str | None:
    """Make OpenMP threads spin briefly, then sleep (DEFAULT_ENV; with `threaded`, for a process
    that runs torch in several threads, THREADED_ENV too), unless the user chose otherwise;
    `import headwise` and the `headwise` command call this before torch loads. Returns why it
    could not, else None."""
    global _warned, _ours
    chosen = [v for v in POLICY_VARS if v in os.environ]
    if chosen and not _ours:
        return None  # the user's choice, whatever it is
    if not openmp_loaded():
        os.environ.update(DEFAULT_ENV)
        if threaded:
            os.environ.update(THREADED_ENV)
        _ours = True
        return None
    if chosen:
        return None  # ours, set before torch loaded
    reason = (
        "torch (and its OpenMP runtime) was imported before headwise, with neither OMP_WAIT_POLICY nor "
        "GOMP_SPINCOUNT set, so its threads spin ~3 ms between ops; on a machine shared with another busy "
        "process decoding can be several times slower. Fix: `import headwise` before torch, or run with "
        f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT} (or OMP_WAIT_POLICY=PASSIVE) in the environment; "
        "OMP_WAIT_POLICY=ACTIVE silences this and keeps spinning."
    )
    if not _warned:
        _warned = True
        warnings.warn(reason, ThreadWaitWarning, stacklevel=3)
    return reason
