"""A rank that dies (or goes silent) mid-run makes the others fail at their next collective
with ParallelError naming the call, within the group's timeout: no rank hangs."""

import multiprocessing.connection
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import pytest

from headwise.parallel import RankGroup, spawn

from . import ranks

TIMEOUT_S = 1.0  # the process group's timeout: how long a collective waits for a silent rank


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_others_fail_fast_with_a_clear_error(how):
    outcomes = spawn(ranks.die_mid_run, 2, how, timeout_s=TIMEOUT_S, deadline_s=60, raise_on_failure=False)
    survivor = outcomes[0]
    assert survivor.ok, survivor.error  # it returned: the failure was caught, not a hang or a crash
    error, seconds = survivor.value["error"], survivor.value["seconds"]
    assert error is not None and error.startswith("ParallelError: rank 0 of 2: the all-reduce of layer 0 attention")
    assert "another rank exited or stopped answering" in error and "restart all of them" in error
    assert seconds < TIMEOUT_S + 10  # the group's timeout bounds the wait (slack for a busy machine)
    if how == "exit":
        assert not outcomes[1].ok and outcomes[1].error == "exited with code 3 before answering"
    else:
        assert outcomes[1].ok and outcomes[1].value == {"stalled": True}


def test_a_killed_follower_reads_the_same_to_every_thread(monkeypatch):
    """A server asks its RankGroup from two threads at once (the watchdog and a failing step). The
    forkserver hands a child's exit status over once, after `connection.wait` says it is there:
    unguarded, a second reader between the two saw EOF, "exited with code 255", instead of the
    signal. The window is widened here (50 ms after each wait) so that the race is certain."""
    group = RankGroup(ranks.wait_to_be_killed, 2, timeout_s=5.0)
    try:
        (pid,) = group.pids().values()
        os.kill(pid, signal.SIGKILL)
        wait([p.sentinel for p in group.procs.values()])  # the status is readable now

        def slow_wait(*args, **kwargs):
            ready = wait(*args, **kwargs)
            time.sleep(0.05)
            return ready

        monkeypatch.setattr(multiprocessing.connection, "wait", slow_wait)
        seen = []
        threads = [threading.Thread(target=lambda: seen.append(group.failure(wait_s=0))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert seen == ["rank 1 of 2 was killed by SIGKILL"] * 4
    finally:
        monkeypatch.undo()
        outcomes = group.close(timeout=0)
    assert outcomes[0].error == "exited with code -9 before answering"
