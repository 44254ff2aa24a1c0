"""Threads that fit the machine, end to end: beside a spinning process the governor, reading this
machine's /proc/stat, takes fewer threads than cores, and the count generate() and the engine report (pinned here, 1 then 2) is
the one torch runs their steps with, read by torch in the stepping thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

import headwise
from headwise.core.governor import ThreadGovernor, this_machine
from headwise.runtime.threads import GOVERNOR, pin_threads

from ..core.test_governor import in_thread


def test_beside_a_busy_process_fewer_threads_than_cores():
    """A governor as the process's (this machine's /proc/stat, torch's count), fitting for 1 s
    (4 readings; longer while none counts) in a thread of its own as a decode loop would, beside a spinning process."""
    meter, default, ceiling = this_machine({})
    gov = ThreadGovernor(torch.get_num_threads, torch.set_num_threads, meter, default=default, ceiling=ceiling, env={})
    before = torch.get_num_threads()
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])

    def fitting():
        torch.set_num_threads(default)  # as a thread starts where nobody set a count
        gov.restart(ceiling)  # the reading starts now, with the spinner running
        # 1 s, longer (up to 10 s) while no reading counted: an interval in which this process got
        # under half a core (a machine loaded far past its cores) is not a reading (core/governor.py)
        start = time.monotonic()
        while time.monotonic() < start + 1.0 or (gov.others == 0 and time.monotonic() < start + 10):
            n = gov.fit()
            step = time.monotonic() + 0.02  # a step's work: a decode loop keeps its core busy
            while time.monotonic() < step:
                pass
        return n, torch.get_num_threads()

    try:
        fitted, torch_runs = in_thread(fitting)
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(before)
    assert fitted == torch_runs  # what torch runs in the thread that asked
    assert gov.others >= 0.6, gov.others  # the spinner's core at least (the machine may be busier still)
    assert 1 <= fitted <= max(1, meter.cores - 1)  # fewer than the cores, never 0


def _recorder(seen: list):
    """A logits processor (runs in the stepping thread): what torch runs there, and which thread."""

    def proc(logits, requests):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return logits

    return proc


def test_generate_and_engine_report_the_count_their_steps_ran_with(tiny_llama):
    seen: list = []
    params = headwise.SamplingParams(max_new_tokens=4, temperature=0, logits_processors=(_recorder(seen),))
    try:
        for n in (1, 2):
            pin_threads(n)
            seen.clear()
            res = headwise.generate(tiny_llama, [1, 2, 3], params)
            assert {c for _, c in seen} == {n} and res.threads == n

            engine = headwise.Engine(tiny_llama, max_num_seqs=2)
            engine.start()
            try:
                seen.clear()
                engine.generate([[1, 2, 3], [4, 5]], params)
            finally:
                engine.shutdown()
            assert len({t for t, _ in seen}) == 1 and seen[0][0] != threading.get_ident()  # the engine's thread
            assert {c for _, c in seen} == {n} and engine.stats().threads == n
            assert engine.stats().as_dict()["threads"] == n  # what /metrics exports (headwise_engine_threads)
    finally:
        pin_threads(None)
    # governed again: what the next step would take, within the cores
    assert 1 <= GOVERNOR.planned() <= (os.cpu_count() or 1)


def test_changing_the_count_back_and_forth_starts_no_threads():
    """libgomp keeps one pool per thread and reuses it: 200 changes between 1 and 2 threads, each
    with a parallel op, leave this process with the threads it had."""
    x = torch.randn(128, 128)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    x @ x
    tasks = len(os.listdir("/proc/self/task"))
    try:
        for i in range(200):
            torch.set_num_threads(1 + i % 2)
            x @ x
    finally:
        torch.set_num_threads(before)
    assert len(os.listdir("/proc/self/task")) == tasks
