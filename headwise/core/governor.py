"""Threads that fit the machine: as many torch threads as the cores other processes leave (issue 42).

Beside one busy single-thread process on 2 cores, two OpenMP threads decode SmolLM2 at ~0.23x
their quiet speed: every parallel region waits for the worker the scheduler parked to let the
neighbour run. One thread beside it decodes about as fast as one thread alone (benchmarks/busy.py,
1thread). So the count follows what the cores are doing, measured, not guessed:

    others  = busy CPU time of the counted CPUs (steal included) - this process's CPU time,
              over the last interval, in cores
    threads = cores - round(others), within [1, ceiling]

`cores` are the CPUs this process may run on; `ceiling` is torch's own default (physical cores)
or fewer. The count moves only when `others` is more than MARGIN past a rounding point: a
neighbour using 0.1 core costs nothing, and a reading near 0.5 does not flap. `fit()` is called
before every step (runtime/core.py): a clock check; /proc/stat is read only every INTERVAL_S.
An interval counts only if this process stepped through it (used STEPPING cores or more, or
its stepping thread ran and waited for a CPU that long: on a machine loaded past its cores a
stepping process gets under half a core, and that is when a thread must go): the neighbours of
an idle gap may be gone when stepping resumes.
Niced processes (`nice` column) count only when this process is niced too: at nice 0 our
threads take ~98% of a core from a nice-19 job, so it does not cost a thread.

The count is per OS thread: libgomp keeps nthreads-var per calling thread, and the C kernels'
`#pragma omp parallel` takes the caller's; so `fit()` sets it in the thread that runs the ops.
Several threads stepping at once (two engines) share the count.

A pinned count wins and turns this off: HEADWISE_THREADS=N (or `pin(N)`, `headwise generate
--threads N`) sets N in every stepping thread; OMP_NUM_THREADS / MKL_NUM_THREADS (torch's own
pins) and a torch.set_num_threads(n) other than the count expected are left as they are. A
torch.set_num_threads equal to torch's default cannot be told from the default: pin with
HEADWISE_THREADS. Without /proc/stat (off Linux) the count is left to torch, as before.
"""

from __future__ import annotations

import glob
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

ENV = "HEADWISE_THREADS"
TORCH_PINS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch takes its count from these when set
INTERVAL_S = 0.25  # between two readings of /proc/stat: a few decode steps, long enough for 100 Hz ticks
STALE_S = 5.0  # an interval longer than this (an idle engine) is not a reading of now: start a new one
MARGIN = 0.1  # cores past a rounding point before the count moves (hysteresis)
ACTIVE_S = 4 * INTERVAL_S  # a thread that stepped this recently shares the count
STEPPING = 0.5  # cores this process used over an interval for it to count as a reading (not idle)


@dataclass(frozen=True)
class CpuTimes:
    wall: float  # monotonic seconds
    busy: float  # CPU-seconds the counted CPUs were busy (or stolen) since boot
    ours: float  # this process's CPU-seconds, all its threads
    waited: float = 0.0  # seconds the sampling thread spent runnable but waiting for a CPU
    thread: int = 0  # which thread sampled (`waited` is per thread)


class CpuMeter:
    """Readings of /proc/stat and of this process's CPU time. cpus: the CPU numbers to count
    (their `cpuN` lines), None for all (the `cpu` line). nice: count the `nice` column as busy."""

    def __init__(
        self,
        stat_path: str = "/proc/stat",
        cpus: frozenset[int] | None = None,
        *,
        nice: bool = False,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        hz: int | None = None,
        waited: Callable[[], float] | None = None,
    ):
        self.stat_path, self.cpus, self.nice = stat_path, cpus, nice
        self.clock, self.cpu_time = clock, cpu_time
        # the thread's run-queue wait: real only with the real clocks (a fake meter's intervals)
        real = clock is time.monotonic and cpu_time is time.process_time
        self.waited = waited or (_run_delay if real else (lambda: 0.0))
        self.hz = hz or os.sysconf("SC_CLK_TCK")
        self._size = 4096
        online = sum(1 for line in _cpu_lines(stat_path, self._size) if line[3:4].isdigit())  # OSError off Linux
        self._size = 128 * (online + 2)  # the cpu lines in one read, mostly (the rest of the file is long)
        self.cores = len(cpus) if cpus is not None else online

    def sample(self) -> CpuTimes:
        ticks = 0
        for line in _cpu_lines(self.stat_path, self._size):
            name, *cols = line.split()
            if (name == b"cpu") if self.cpus is None else (name != b"cpu" and int(name[3:]) in self.cpus):
                # user nice system idle iowait irq softirq steal (guest time is inside user/nice)
                ticks += sum(int(cols[i]) for i in (0, 2, 5, 6, 7)) + (int(cols[1]) if self.nice else 0)
        return CpuTimes(self.clock(), ticks / self.hz, self.cpu_time(), self.waited(), threading.get_ident())

    @staticmethod
    def others(before: CpuTimes, after: CpuTimes) -> float:
        """Cores the other processes (and the hypervisor's steal) kept busy between two readings."""
        wall = after.wall - before.wall
        if wall <= 0:
            return 0.0
        return max(0.0, (after.busy - before.busy) - (after.ours - before.ours)) / wall


def _run_delay() -> float:
    """Seconds this thread has waited on a run queue (/proc/thread-self/schedstat; 0 without)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _cpu_lines(path: str, size: int) -> list[bytes]:
    """The `cpu` lines that open /proc/stat, read raw (~half the time of a text file's lines)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size)
        while b"\nintr" not in data:  # more cpus than the guess: read on
            more = os.read(fd, size)
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    end = next((i for i, line in enumerate(lines) if not line.startswith(b"cpu")), len(lines))
    return lines[:end]


def choose(others: float, cores: int, current: int, ceiling: int, margin: float = MARGIN) -> int:
    """The count for `others` busy cores out of `cores`, staying at `current` while the free
    cores are within 0.5 + margin of it."""
    free = cores - others
    n = current if abs(free - current) <= 0.5 + margin else math.floor(free + 0.5)
    return max(1, min(ceiling, n))


def parse_count(value: str, source: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{source}={value!r} is not a thread count: give a whole number >= 1, or unset it")
    return n


def physical_cores(cpus) -> int:
    """Distinct (package, core) pairs among `cpus` (SMT siblings count once), as torch counts
    its default; len(cpus) where the topology is not readable."""
    seen = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as p, open(base + "core_id") as k:
                seen.add((p.read().strip(), k.read().strip()))
        except OSError:
            return len(cpus)
    return len(seen) or len(cpus)


def this_machine(env: Mapping[str, str] = os.environ) -> tuple[CpuMeter | None, int, int]:
    """(a meter of the CPUs this process may use or None off Linux, torch's default count,
    the ceiling: that default within those CPUs)."""
    online = sorted(int(p.rsplit("cpu", 1)[1]) for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*"))
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
    pins = [env[v] for v in TORCH_PINS if env.get(v)]
    default = physical_cores(online) if online else (os.cpu_count() or 1)
    if pins:
        default = int(pins[-1]) if pins[-1].isdigit() else default  # MKL_NUM_THREADS wins, as in torch
    try:
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        meter = CpuMeter(cpus=None if set(mine) >= set(online) else frozenset(mine), nice=niced)
    except (OSError, AttributeError, ValueError):
        return None, default, default
    return meter, default, max(1, min(default, physical_cores(mine) if mine else default))


class ThreadGovernor:
    """Decides and sets the calling thread's torch thread count (see the module doc).

    get_threads / set_threads: torch.get_num_threads / torch.set_num_threads (core/ has no torch).
    meter: None leaves the count to torch (no /proc). default: torch's own count when nobody set
    one; ceiling: the most it sets. env: where HEADWISE_THREADS and torch's pins are read."""

    def __init__(
        self,
        get_threads: Callable[[], int],
        set_threads: Callable[[int], None],
        meter: CpuMeter | None,
        *,
        default: int,
        ceiling: int,
        env: Mapping[str, str] = os.environ,
        interval: float = INTERVAL_S,
    ):
        self._get, self._set = get_threads, set_threads
        self.meter, self.default, self.ceiling, self.interval = meter, default, ceiling, interval
        self.pinned, self.error = None, None
        try:
            self.pinned = parse_count(env[ENV], ENV) if env.get(ENV) else None
        except ValueError as e:  # raised at the first step, not at import: `headwise plan` still runs
            self.error = str(e)
        self.torch_pin = next((v for v in TORCH_PINS if env.get(v)), None)  # left to torch
        self.target = ceiling  # the process's count, before it is shared among stepping threads
        self.others = 0.0  # the last reading, in cores
        self._lock = threading.Lock()
        self._tls = threading.local()  # per thread: gen, count, user (a count the user set there)
        self._gen = 0  # bumped at every reading and pin: each thread looks again once
        self._active: dict[int, float] = {}  # thread id -> when it last looked
        self._last_set: int | None = None  # torch's process-wide count as we last set it
        self._clock = meter.clock if meter is not None else time.monotonic
        self._prev = meter.sample() if meter is not None else None
        self._due = self._prev.wall + interval if self._prev is not None else math.inf  # never, without /proc

    @property
    def governed(self) -> bool:
        return self.pinned is None and self.torch_pin is None and self.meter is not None

    def planned(self) -> int:
        """The count a thread's next step takes, unless the user set that thread's own."""
        if self.pinned is not None:
            return self.pinned
        return self.target if self.governed else self.default

    def pin(self, n: int | None) -> None:
        """Pin every stepping thread to n threads from its next step; None: govern again."""
        if n is not None:
            n = parse_count(str(n), "threads")
        with self._lock:
            self.pinned = n
            self._gen += 1

    def restart(self, ceiling: int) -> int:
        """A new process's start (a tensor-parallel rank, forked): at most `ceiling` threads from
        now, measured from a fresh reading, and set in this thread at once (a pinned count
        instead, where one is). -> the count set."""
        with self._lock:
            self.ceiling = self.target = max(1, ceiling)
            if self.meter is not None:  # the parent's reading counts the parent's CPU time as ours
                self._prev = self.meter.sample()
                self._due = self._prev.wall + self.interval
            self._active.clear()
            self._gen += 1
            n = self.pinned if self.pinned is not None else self.ceiling
            self._set(n)
            self._last_set = n
            tls = self._tls
            tls.gen, tls.count, tls.user = self._gen, n, False
            return n

    def fit(self) -> int:
        """Before a step, in the thread that runs it: set and return its thread count."""
        tls = self._tls
        if getattr(tls, "gen", -1) == self._gen and self._clock() < self._due:
            return tls.count  # the common case: a clock read and two compares
        return self._look(tls)

    def _look(self, tls) -> int:
        if self.error is not None:
            raise ValueError(self.error)
        with self._lock:
            now = self._read() if self.meter is not None else self._clock()
            me = threading.get_ident()
            self._active[me] = now
            if self._gen != getattr(tls, "gen", -1):
                for t in [t for t, seen in self._active.items() if now - seen > ACTIVE_S]:
                    del self._active[t]
            tls.gen, sharing = self._gen, len(self._active)
            current = self._get()
            if self.pinned is None and not hasattr(tls, "user"):
                # a thread's first look: a count other than the one expected was set by the user
                expected = self._last_set if self._last_set is not None else self.default
                tls.user = current != expected
            elif self.pinned is None and not tls.user and current != tls.count:
                tls.user = True  # torch.set_num_threads between two steps
            if self.pinned is not None:
                want = self.pinned
            elif tls.user or not self.governed:
                want = current
            else:
                want = max(1, self.target // sharing)
            if want != current:
                self._set(want)
                self._last_set = want
            tls.count = want
            return want

    def _read(self) -> float:
        """Take a reading when due and move the process's count; -> the clock."""
        now = self.meter.clock()
        if now < self._due:
            return now
        cur = self.meter.sample()
        wall = cur.wall - self._prev.wall
        # a reading of now only if this process was stepping through it (used STEPPING cores or
        # more): over an idle gap it would count a neighbour that may have stopped as we resume
        # (llama-bench between two of our runs read 1.9 cores: our next step ran 1 thread); or if
        # its stepping thread waited for a CPU through it (starved, not idle: an idle one sleeps)
        waited = cur.waited - self._prev.waited if cur.thread == self._prev.thread else 0.0
        if wall <= STALE_S and cur.ours - self._prev.ours + waited >= STEPPING * wall:
            self.others = CpuMeter.others(self._prev, cur)
            self.target = choose(self.others, self.meter.cores, self.target, self.ceiling)
        self._prev, self._due = cur, cur.wall + self.interval
        self._gen += 1
        return now
