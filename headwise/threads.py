"""OpenMP waits passively, so headwise decodes well on a machine it shares.

PyTorch's CPU ops, MKL, oneDNN and our C kernel (headwise/kernels) all run on one OpenMP
runtime (torch's libgomp). Between two parallel regions its worker threads wait, and by default
libgomp spins for GOMP_SPINCOUNT=300000 rounds (~3 ms) before it sleeps; OMP_WAIT_POLICY=ACTIVE
spins for minutes. A decode step is hundreds of short parallel regions, so the workers spin
nearly all the time, and when another process wants a core the spinning threads and that
process take turns: each region waits a scheduler slice for a worker that was descheduled
(measured in benchmarks/busy.py). OMP_WAIT_POLICY=PASSIVE (GOMP_SPINCOUNT=0: sleep at once)
gives the cores back as soon as a region ends.

libgomp reads its environment once, when it is loaded, i.e. when torch is imported. So
`import headwise` sets OMP_WAIT_POLICY=PASSIVE if no OpenMP runtime is loaded yet (setdefault:
a value you set wins, so OMP_WAIT_POLICY=ACTIVE or GOMP_SPINCOUNT=N still work). If torch was
imported first it is too late to change the policy from Python, and headwise says so once,
with the fix.
"""
from __future__ import annotations

import os
import warnings

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")   # either one sets how libgomp's threads wait


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


def configure_wait_policy() -> str | None:
    """Make OpenMP threads wait passively unless the user chose otherwise; `import headwise` and
    the `headwise` command call this before torch loads. Returns why it could not, else None."""
    global _warned
    chosen = [v for v in POLICY_VARS if v in os.environ]
    if chosen:
        return None                                   # the user's choice, whatever it is
    if not openmp_loaded():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return None
    reason = ("torch (and its OpenMP runtime) was imported before headwise, with no OMP_WAIT_POLICY set, so "
              "its threads spin between ops (~3 ms each wait); on a machine shared with another busy process "
              "decoding can be several times slower. Fix: `import headwise` before torch, or run with "
              "OMP_WAIT_POLICY=PASSIVE in the environment (OMP_WAIT_POLICY=ACTIVE silences this and keeps "
              "spinning).")
    if not _warned:
        _warned = True
        warnings.warn(reason, ThreadWaitWarning, stacklevel=3)
    return reason
