"""The thread governor's rule (core/governor.py) on /proc/stat files written here, and the count it
sets as torch itself reports it, in threads of their own (OpenMP's count is per thread).

The rule under test, from the module doc: others = busy CPU time (steal included, nice only when
we are niced) - our CPU time, over the interval, in cores; threads = cores - round(others),
within [1, ceiling], moving only when others is more than MARGIN past a rounding point."""

from __future__ import annotations

import threading

import pytest
import torch

from headwise.core.governor import ENV, MARGIN, CpuMeter, ThreadGovernor, choose, parse_count

HZ = 100


class FakeProc:
    """A /proc/stat of `cpus` CPUs whose counters advance as told, a clock and our CPU time."""

    def __init__(self, path, cpus: int = 2):
        self.path, self.now, self.ours, self.waited = path, 1000.0, 0.0, 0.0
        # per cpu: user nice system idle iowait irq softirq steal guest guest_nice, in ticks
        self.cols = [[0] * 10 for _ in range(cpus)]
        self.write()

    def write(self) -> None:
        total = [sum(c[i] for c in self.cols) for i in range(10)]
        lines = ["cpu  " + " ".join(map(str, total))]
        lines += [f"cpu{i} " + " ".join(map(str, c)) for i, c in enumerate(self.cols)]
        self.path.write_text("\n".join(lines + ["intr 1 0 0", "ctxt 5", "btime 1"]) + "\n")

    def advance(
        self, seconds: float, busy: dict[int, float], ours: float = 0.0, col: int = 0, waited: float = 0.0
    ) -> None:
        """`seconds` pass; CPU i is busy busy[i] of them (in column `col`: 0 user, 1 nice, 7
        steal), idle the rest; this process kept `ours` cores of that busy; the sampling thread
        waited for a CPU `waited` of them."""
        for i, c in enumerate(self.cols):
            b = round(busy.get(i, 0.0) * seconds * HZ)
            c[col] += b
            c[3] += round(seconds * HZ) - b
        self.now += seconds
        self.ours += ours * seconds
        self.waited += waited * seconds
        self.write()

    def meter(self, cpus=None, nice=False) -> CpuMeter:
        return CpuMeter(
            str(self.path),
            cpus,
            nice=nice,
            clock=lambda: self.now,
            cpu_time=lambda: self.ours,
            hz=HZ,
            waited=lambda: self.waited,
        )


@pytest.fixture
def proc(tmp_path):
    return FakeProc(tmp_path / "stat")


def others_over(proc, meter, seconds, busy, ours=0.0, col=0) -> float:
    before = meter.sample()
    proc.advance(seconds, busy, ours, col)
    return CpuMeter.others(before, meter.sample())


def test_others_is_busy_time_minus_ours(proc):
    m = proc.meter()
    assert m.cores == 2
    # a neighbour at 100% of CPU 0, our 1.0 s of work on CPU 1 over 1 s: one other core
    assert others_over(proc, m, 1.0, {0: 1.0, 1: 1.0}, ours=1.0) == pytest.approx(1.0)
    # nothing but us: none
    assert others_over(proc, m, 0.5, {0: 1.0, 1: 1.0}, ours=2.0) == pytest.approx(0.0)
    # steal is a core the hypervisor gave someone else
    assert others_over(proc, m, 1.0, {0: 0.5}, col=7) == pytest.approx(0.5)
    # a niced neighbour takes nothing from us at nice 0; it counts when we are niced too
    assert others_over(proc, m, 1.0, {0: 1.0}, col=1) == pytest.approx(0.0)
    assert others_over(proc, proc.meter(nice=True), 1.0, {0: 1.0}, col=1) == pytest.approx(1.0)


def test_only_the_cpus_we_may_use_count(proc):
    m = proc.meter(cpus=frozenset({1}))
    assert m.cores == 1
    assert others_over(proc, m, 1.0, {0: 1.0}) == pytest.approx(0.0)  # CPU 0 is not ours to use
    assert others_over(proc, m, 1.0, {1: 0.75}) == pytest.approx(0.75)


@pytest.mark.parametrize(
    "others, current, expected",
    [
        (1.0, 2, 1),  # 2 cores, a neighbour at 100%: one thread
        (0.1, 2, 2),  # a neighbour's tenth of a core costs nothing
        (0.5 + MARGIN - 0.01, 2, 2),  # within the margin: stays
        (0.5 + MARGIN + 0.01, 2, 1),
        (0.5 - MARGIN + 0.01, 1, 1),  # and back: only once clearly below
        (0.5 - MARGIN - 0.01, 1, 2),
        (1.9, 2, 1),  # never below one
        (0.0, 1, 2),
    ],
)
def test_choose_two_cores(others, current, expected):
    assert choose(others, 2, current, ceiling=2) == expected


def test_choose_stays_within_the_ceiling():
    assert choose(1.0, 16, 8, ceiling=8) == 8  # 15 free logical CPUs, 8 physical cores: torch's most
    assert choose(9.0, 16, 8, ceiling=8) == 7
    assert choose(0.0, 4, 1, ceiling=4) == 4


def in_thread(fn):
    """fn() in a new thread (its own OpenMP count) -> its result."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # also torch's process-wide count, which new threads start from


def governor(proc, env=None, ceiling=2, default=None, interval=0.25) -> ThreadGovernor:
    return ThreadGovernor(
        torch.get_num_threads,
        torch.set_num_threads,
        proc.meter(),
        default=default if default is not None else torch.get_num_threads(),
        ceiling=ceiling,
        env=env or {},
        interval=interval,
    )


def test_fits_torch_in_the_calling_thread(proc, restore_threads):
    g = governor(proc)

    def run():
        counts = [g.fit()]  # no reading yet: the ceiling
        proc.advance(0.3, {0: 1.0, 1: 0.5}, ours=0.5)  # a neighbour holds a core
        counts.append(g.fit())
        counts.append(torch.get_num_threads())  # what torch itself runs with, here
        proc.advance(0.1, {0: 0.0, 1: 1.0}, ours=1.0)  # not due yet (0.25 s): no reading
        counts.append(g.fit())
        proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=2.0)  # gone: we use both
        counts.append(g.fit())
        counts.append(torch.get_num_threads())
        return counts

    assert in_thread(run) == [2, 1, 1, 1, 2, 2]


def test_headwise_threads_pins(proc, restore_threads):
    g = governor(proc, env={ENV: "1"})

    def run():
        proc.advance(0.3, {})  # an idle machine
        return g.fit(), torch.get_num_threads()

    assert in_thread(run) == (1, 1)
    g.pin(2)
    assert in_thread(lambda: (proc.advance(0.3, {0: 1.0, 1: 1.0}), g.fit(), torch.get_num_threads())[1:]) == (2, 2)
    bad = governor(proc, env={ENV: "two"})  # made (an import does not fail), but no step runs with it
    with pytest.raises(ValueError, match="HEADWISE_THREADS='two' is not a thread count"):
        in_thread(bad.fit)
    with pytest.raises(ValueError, match="threads='0'"):
        parse_count("0", "threads")


def test_a_count_the_user_set_is_left_alone(proc, restore_threads):
    g = governor(proc, default=2)

    def run():
        torch.set_num_threads(1)  # the user's, before the first step
        proc.advance(0.3, {})  # idle: the governor would take 2
        first = g.fit(), torch.get_num_threads()
        return first

    assert in_thread(run) == (1, 1)
    # torch's own pin (OMP_NUM_THREADS) is left to torch
    g = governor(proc, env={"OMP_NUM_THREADS": "2"}, default=2)
    assert not g.governed
    proc.advance(0.3, {0: 1.0, 1: 1.0})  # a busy machine: governed, this would be 1
    assert in_thread(lambda: (torch.set_num_threads(2), g.fit(), torch.get_num_threads())[1:]) == (2, 2)


def test_threads_stepping_at_once_share_the_count(proc, restore_threads):
    g = governor(proc, ceiling=2, default=torch.get_num_threads())
    ready, go = threading.Barrier(2), threading.Event()
    seen = {}

    def stepper(name):
        g.fit()
        ready.wait()
        go.wait()
        seen[name] = (g.fit(), torch.get_num_threads())

    threads = [threading.Thread(target=stepper, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=2.0)  # both cores ours: 2 threads between two steppers
    go.set()
    for t in threads:
        t.join()
    assert seen == {"a": (1, 1), "b": (1, 1)}


def test_no_proc_stat_leaves_torch_alone(restore_threads):
    g = ThreadGovernor(torch.get_num_threads, torch.set_num_threads, None, default=2, ceiling=2, env={})
    assert not g.governed
    assert in_thread(lambda: (torch.set_num_threads(1), g.fit())[1]) == 1
    before, fitted, after = in_thread(lambda: (torch.get_num_threads(), g.fit(), torch.get_num_threads()))
    assert fitted == before == after


def test_an_interval_this_process_sat_idle_is_not_a_reading(proc, restore_threads):
    """Neighbours busy while we did not step (llama-bench between two of our runs) say nothing of
    now: the count holds until an interval we stepped through says otherwise."""
    g = governor(proc)

    def run():
        counts = [g.fit()]
        proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=0.0)  # both cores busy, none of it ours: idle gap
        counts.append(g.fit())
        proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=1.0)  # stepping beside a neighbour holding a core
        counts.append(g.fit())
        return counts

    assert in_thread(run) == [2, 2, 1]


def test_an_interval_this_process_stepped_through_starved_is_a_reading(proc, restore_threads):
    """On a machine loaded past its cores a stepping process gets under half a core; its stepping
    thread waited for a CPU through the interval (schedstat's run delay): that is a reading, and
    a thread goes. An idle one does not wait (it sleeps): no reading."""
    g = governor(proc)

    def run():
        counts = [g.fit()]
        for _ in range(2):  # the first interval began in another thread (its wait is not this one's)
            proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=0.3, waited=0.6)  # starved, stepping: 1.7 cores others'
            counts.append(g.fit())
        proc.advance(0.3, {0: 1.0, 1: 1.0}, ours=0.0, waited=0.0)  # then idle (asleep) beside them
        counts.append(g.fit())
        proc.advance(0.3, {0: 1.0}, ours=1.0)  # they have gone: stepping alone
        counts.append(g.fit())
        return counts

    assert in_thread(run) == [2, 2, 1, 1, 2]
