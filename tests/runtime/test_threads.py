"""Threads that fit the machine, end to end: a fresh process beside a spinning one takes fewer
threads than cores, and the count generate() and the engine report (pinned here, 1 then 2) is
the one torch runs their steps with, read by torch in the stepping thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch

import headwise
from headwise.runtime.threads import GOVERNOR, pin_threads

# Fits for 1 s (4 readings), as a decode loop would, then says what it chose and what torch runs.
CHILD = """
import json, time
from headwise.runtime.threads import GOVERNOR, fit_threads
import torch
first = torch.get_num_threads()  # torch's own default here (nothing set)
end = time.monotonic() + 1.0
while time.monotonic() < end:
    n = fit_threads()
    time.sleep(0.02)
out = {"fit": n, "torch": torch.get_num_threads(), "others": GOVERNOR.others, "cores": GOVERNOR.meter.cores}
print(json.dumps({**out, "torch_default": first, "expected_default": GOVERNOR.default}))
"""


def test_beside_a_busy_process_fewer_threads_than_cores():
    env = {k: v for k, v in os.environ.items() if k not in ("HEADWISE_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    finally:
        spinner.kill()
        spinner.wait()
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["expected_default"] == out["torch_default"], out  # how a count the user set is told apart
    assert out["fit"] == out["torch"], out  # what torch runs in the thread that asked
    assert out["others"] >= 0.6, out  # the spinner's core at least (the machine may be busier still)
    assert out["fit"] == max(1, min(out["cores"] - 1, out["fit"])), out  # fewer than the cores, never 0


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
