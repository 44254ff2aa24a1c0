"""Issue 43's start-up interruptions: `headwise serve MODEL` stopped at a random moment of its
start-up (SIGINT, SIGTERM), or started on a port another socket holds, many times. Before the fix,
a signal while the models loaded ended in `terminate called without an active exception` (exit 134)
and a busy port in `FATAL: exception not rethrown` after a banner announcing the URL.

Expected: a signal -> exit 0 (SIGTERM) or 130 (SIGINT) with one stderr line ("headwise serve:
stopped while loading (SIGTERM)"), or, when the signal came after the models had loaded, the
graceful shutdown (exit 0, nothing on stderr at --log-level warning); a busy port -> exit 2, one
line naming --port and `make run PORT=`, no banner. Delays are uniform over [0, time to /health
200], measured first on this machine (the mean of two start-ups). Every stderr line that is not
the expected one is printed. "killed by SIGTERM before headwise's handler": the signal came before
the interpreter ran `headwise serve`'s first line (the default action; not an abort).

    .venv/bin/python benchmarks/lifecycle.py --runs 100             # ~8 min; results/lifecycle.txt
    .venv/bin/python benchmarks/lifecycle.py --runs 100 --guard-first   # results/lifecycle_guard_first.txt
    .venv/bin/python benchmarks/lifecycle.py --runs 12 --no-save --model /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_model, free_port, loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "headwise.cli"]
# What `headwise` does once cli/__init__.py main() calls startup.guard() first for `serve`: the
# signals are ours from the first import on (until then the imports' window is Python's default)
GUARDED = [
    sys.executable,
    "-c",
    "import sys; from headwise.cli.startup import guard; guard(); from headwise.cli import main; "
    "sys.exit(main(sys.argv[1:]))",
]
STOPPED = re.compile(r"^headwise serve: stopped while (starting|loading) \((SIGINT|SIGTERM)\)$")
CODES = {"SIGINT": 130, "SIGTERM": 0}


def start(entry: list[str], model: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [*entry, "serve", model, "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def calibrate(entry: list[str], model: str) -> tuple[float, float]:
    """Seconds from spawn to the banner and to /health 200 (the start-up the delays span)."""
    port = free_port()
    t0 = time.monotonic()
    proc = start(entry, model, port)
    banner = []
    threading.Thread(target=lambda: banner.append((proc.stdout.readline(), time.monotonic())), daemon=True).start()
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    ready = time.monotonic() - t0
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    return (banner[0][1] - t0 if banner else float("nan")), ready


def one(kind: str, delay: float, entry: list[str], model: str) -> dict:
    """One start-up: `kind` SIGINT / SIGTERM after `delay` s, or "busy port"."""
    holder = None
    port = free_port()
    if kind == "busy port":
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
    proc = start(entry, model, port)
    sent = time.monotonic()
    try:
        if holder is None:
            time.sleep(delay)
            sent = time.monotonic()
            proc.send_signal(getattr(signal, kind))
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(benchmark: no exit within 120 s; killed)"
    finally:
        if holder is not None:
            holder.close()
    took = time.monotonic() - sent  # signal (or spawn, for a busy port) to exit
    return {"kind": kind, "delay": delay, "code": proc.returncode, "out": out, "err": err, "took": took}


def judge(r: dict) -> tuple[str, list[str]]:
    """(outcome, unexpected stderr lines) of one run."""
    lines = [line for line in r["err"].splitlines() if line.strip()]
    if r["code"] in (-6, 134) or "terminate called" in r["err"] or "FATAL" in r["err"]:
        return "ABORT", lines
    if "Traceback" in r["err"]:
        return "TRACEBACK", lines[-1:]
    if r["kind"] == "busy port":
        ok = r["code"] == 2 and len(lines) == 1 and "--port" in lines[0] and "make run PORT=" in lines[0]
        ok = ok and "headwise serve: http" not in r["out"]  # no banner announcing a URL that will not serve
        return ("one line, no banner" if ok else "UNEXPECTED"), ([] if ok else lines)
    if r["code"] is not None and r["code"] < 0 and not lines:
        # the default action: the signal came before the interpreter ran any headwise code
        return f"killed by {signal.Signals(-r['code']).name} before headwise's handler", []
    if len(lines) == 1 and (m := STOPPED.match(lines[0])) and m.group(2) == r["kind"]:
        ok = r["code"] == CODES[r["kind"]]
        return (f"one line: stopped while {m.group(1)}" if ok else "UNEXPECTED"), ([] if ok else lines)
    if not lines and r["code"] == 0 and "KV pool:" in r["out"]:
        return "loaded, then the graceful shutdown", []
    return "UNEXPECTED", lines or [f"(no stderr; stdout: {r['out'][-200:]!r})"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--model", default="smollm2", help="what `headwise serve` loads (default: smollm2)")
    ap.add_argument("--jobs", type=int, default=1, help="start-ups at once (1: the delays mean what they say)")
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument(
        "--guard-first",
        action="store_true",
        help="run through a launcher that calls cli/startup.guard() before the CLI's imports (what `headwise` "
        "does once main() calls it); default: python -m headwise.cli as it is",
    )
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    # a child inherits an ignored SIGINT (this script run as a background job) and would never see it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    entry = GUARDED if args.guard_first else CLI
    load_before = loadavg()
    banner_s, ready_s = (sum(x) / 2 for x in zip(*(calibrate(entry, args.model) for _ in range(2))))  # mean of 2
    rng = random.Random(args.seed)
    kinds = ["SIGINT", "SIGTERM", "busy port"]
    plan = [(kinds[i % 3], rng.uniform(0, ready_s)) for i in range(args.runs)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda p: one(*p, entry, args.model), plan))
    took = time.monotonic() - t0

    counts: collections.Counter = collections.Counter()
    exits = collections.defaultdict(list)  # seconds from the signal to the exit, by row
    odd = []
    for r in runs:
        outcome, lines = judge(r)
        counts[(r["kind"], r["code"], outcome)] += 1
        exits[(r["kind"], r["code"], outcome)].append(r["took"])
        odd += [f"  {r['kind']} at {r['delay']:.2f} s, exit {r['code']}: {line}" for line in lines]

    def spread(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"{xs[0]:.2f} / {xs[len(xs) // 2]:.2f} / {xs[-1]:.2f}"

    rows = [
        f"{k:<10} {str(c):>5}  {o:<45} {n:>4}   {spread(exits[(k, c, o)])}"
        for (k, c, o), n in sorted(counts.items(), key=str)
    ]
    aborts = sum(n for (_, _, o), n in counts.items() if o == "ABORT")
    tracebacks = sum(n for (_, _, o), n in counts.items() if o == "TRACEBACK")
    unexpected = sum(n for (_, _, o), n in counts.items() if o == "UNEXPECTED")
    report = "\n".join(
        [
            f"# benchmarks/lifecycle.py --runs {args.runs} --model {args.model} --jobs {args.jobs} --seed {args.seed}"
            + (" --guard-first" if args.guard_first else ""),
            f"# {cpu_model()}; {os.cpu_count()} CPUs; load average {load_before} before, {loadavg()} after",
            f"# start-up on this machine: banner after {banner_s:.2f} s, /health 200 after {ready_s:.2f} s; "
            f"delays uniform over [0, {ready_s:.2f}] s; {len(runs)} runs in {took:.0f} s",
            "",
            f"{'kind':<10} {'exit':>5}  {'outcome':<45} {'runs':>4}   signal to exit, s (min / median / max)",
            *rows,
            "",
            f"aborts (134, terminate called, FATAL): {aborts}; tracebacks: {tracebacks}; other unexpected: {unexpected}",
            *(["stderr lines that are not the expected one:", *odd] if odd else []),
        ]
    )
    print(report)
    if not args.no_save:
        path = ROOT / "benchmarks" / "results" / ("lifecycle_guard_first.txt" if args.guard_first else "lifecycle.txt")
        path.write_text(report + "\n")
        print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
