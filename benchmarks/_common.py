"""Helpers shared by benchmark scripts: environment capture, interleaved timing,
summaries, peak-memory readings and plain-text tables.

Timing method (the project's standard): warm every contender up, then run
rounds in which each contender runs once, in an order rotated every round, so
slow drift of the machine (thermal, other jobs) hits every contender alike.
Report min / median / max per contender and compare medians.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import random
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

# headwise before torch: `import headwise` sets the OpenMP wait policy users get (headwise/core/threads.py),
# which libgomp reads once, when torch loads it. Scripts import torch only after _common.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import headwise  # noqa: E402,F401
import torch  # noqa: E402


# ---------------------------------------------------------------- servers
_PORTS = random.Random()  # its own generator: benchmarks seed the global one


def free_port() -> int:
    """A free port below the ephemeral range (32768-60999), which other processes' outgoing
    connections draw from: a port the kernel picked there could be taken before a server binds it."""
    while True:
        port = _PORTS.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# ---------------------------------------------------------------- environment
def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> str:
    """The widest x86 vector ISA this CPU has: speed-ups measured on AVX2 did not hold on AVX-512."""
    flags = cpu_flags()
    parts = [
        "AVX-512" + ("+VNNI" if "avx512_vnni" in flags else "")
        if "avx512f" in flags
        else "AVX2"
        if "avx2" in flags
        else "no AVX2"
    ]
    parts += [x.upper() for x in ("fma", "amx_tile") if x in flags]
    return "+".join(parts)


def cpu_model() -> str:
    """The CPU's model name and its vector ISA, e.g. "AMD EPYC [AVX2+FMA]": every result names both."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} [{cpu_isa()}]"


def cpu_tag() -> str:
    """A folder name for this kind of CPU's results, e.g. "amd-f26-avx512" (AMD EPYC Zen 5),
    "intel-f6-m143-avx512-amx", "amd-f25-avx2": vendor, family (and model for Intel, whose
    families do not tell generations apart) and the widest ISA."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = cpu_flags()
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(info.get("vendor_id", ""), "cpu")
    parts = [vendor, f"f{info.get('cpu family', 'x')}"]
    if vendor == "intel":
        parts.append(f"m{info.get('model', 'x')}")
    parts.append("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "noavx2")
    if "amx_tile" in flags:
        parts.append("amx")
    return "-".join(parts)


# The kinds measured before tags existed keep their folders (tables.py's CPUS): Zen 3's runs sit at the
# top level, Zen 4's and Zen 5's under their names. A kind not here gets a folder named by its tag.
FOLDER_OF_TAG = {"amd-f25-avx2": "", "amd-f25-avx512": "zen4", "amd-f26-avx512": "zen5"}


def results_folder() -> str:
    """Where this CPU's results go under benchmarks/results/ ("" = the top level): its known folder or its tag."""
    tag = cpu_tag()
    return FOLDER_OF_TAG.get(tag, tag)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_ticks() -> list[int]:
    """Aggregate /proc/stat cpu counters (user nice system idle iowait irq softirq steal ...)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return []


def busy_and_steal(start: list[int], end: list[int]) -> dict:
    """Share of CPU time, between two cpu_ticks(), that was busy and that the
    hypervisor stole: steal > a few % means another VM was using our cores."""
    if not start or not end:
        return {}
    d = [b - a for a, b in zip(start, end)]
    total = max(sum(d[:8]), 1)
    return {"busy_pct": round(100 * (total - d[3] - d[4]) / total, 1), "steal_pct": round(100 * d[7] / total, 1)}


def environment() -> dict:
    """What a reader needs to judge the numbers: versions, threads, CPU, load, date."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


# --------------------------------------------------------------------- timing
def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round r runs the contenders starting at index r mod n."""
    i = r % len(names)
    return [*names[i:], *names[:i]]


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int | None = None,
    budget_s: float = 20.0,
    min_rounds: int = 5,
    max_rounds: int = 40,
    warmup: int = 2,
) -> tuple[dict[str, list[float]], int]:
    """Time each zero-argument callable in interleaved, rotated rounds.

    With `rounds=None` the number of rounds is chosen so the whole thing takes
    about `budget_s`, clamped to [min_rounds, max_rounds]; the estimate is the last
    warm-up call of each contender. Returns ({name: [seconds per call]}, rounds).
    """
    names = list(fns)
    estimate = {}
    for name in names:
        for _ in range(max(1, warmup)):
            t0 = time.perf_counter()
            fns[name]()
            estimate[name] = time.perf_counter() - t0
    if rounds is None:
        per_round = sum(estimate.values())
        rounds = int(min(max_rounds, max(min_rounds, budget_s // max(per_round, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times, rounds


def paired_candidates(fns: dict, base: str, rounds: int, row: Sequence[object]) -> tuple[dict, list[list]]:
    """Settings of one knob timed against the setting `base`, interleaved (time_interleaved):
    fns {setting: zero-argument callable}. Returns ({setting: {"ms": summarize, "paired_vs_base":
    the median over rounds of that round's base time / its time}}, table lines: `row` + setting,
    min / median / max ms, base / it of the medians, paired)."""
    times, _ = time_interleaved(fns, rounds=rounds)
    ref, res, lines = times[base], {}, []
    for name, t in times.items():
        paired = statistics.median(b / x for b, x in zip(ref, t))
        s = summarize([x * 1e3 for x in t])
        res[name] = {"ms": s, "paired_vs_base": paired}
        lines.append([*row, name, f"{s['min']:.2f}", f"{s['median']:.2f}", f"{s['max']:.2f}",
                      f"{statistics.median(ref) / statistics.median(t):.3f}x", f"{paired:.3f}x"])  # fmt: skip
    return res, lines


def summarize(samples: Sequence[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "n": len(samples)}


# --------------------------------------------------------------------- memory
def maxrss_bytes() -> int:
    """ru_maxrss in bytes (it is KiB on Linux). Careful: a process inherits its
    parent's peak across fork/exec (the forked copy's RSS is recorded at exec), so a
    child of a big process reads far too high; use peak_rss_bytes() there."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """Peak RSS of this process's own memory (VmHWM) since start or the last
    reset_peak_rss(); ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return maxrss_bytes()


def reset_peak_rss() -> bool:
    """Set the peak RSS (VmHWM) to the current RSS, so peak_rss_bytes() measures
    from now on (Linux >= 4.0). False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    """Current resident set size, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------- output
def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Plain-text table; first column left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + [fmt(r) for r in cells[1:]])


class Log:
    """print() that also keeps the lines, so the same text can be saved next to the JSON."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *parts: object) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


if __name__ == "__main__":  # `python benchmarks/_common.py --cpu-tag`: the Makefile's bench-cpu folder (results_folder)
    import sys

    if sys.argv[1:] != ["--cpu-tag"]:
        raise SystemExit("usage: python benchmarks/_common.py --cpu-tag")
    print(results_folder())
