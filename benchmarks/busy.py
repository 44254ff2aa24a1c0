"""One claim: beside a busy process headwise.generate runs as many threads as the cores left, so decoding
keeps at least 0.45x its quiet speed (issue 42: 0.23x with every core's thread), and the governor costs
nothing on a quiet machine (<= 2% slower than the count fixed). Threads fit the machine
(headwise/core/governor.py); between ops they spin briefly, then sleep (headwise/core/threads.py).

Model: SmolLM2-135M-Instruct as `headwise.load("smollm2-135m-instruct")` gives it (the GGUF's Q4_1 blocks),
greedy, EOS ignored, a short chat prompt, --new-tokens decode tokens after a 16-token warm-up generate.
Every measurement is a fresh subprocess (libgomp reads its environment once, when torch loads it), and
reports `GenerationResult.tokens_per_second` (decode only) and `.threads` (the count of its last step).
The child runs with OMP_DISPLAY_ENV=VERBOSE, so the wait policy and spin count libgomp itself took are
read from its stderr, not assumed.

Variants (how the child starts):
  default   `import headwise` first, nothing set: what every user now gets (threads fitted to the free
            cores, looked at every 0.25 s; GOMP_SPINCOUNT=2000)
  fixed     HEADWISE_THREADS=<cores>: the governor off, one thread per core, as before issue 42
  1thread   default + torch.set_num_threads(1) (a count the user set is kept)
  passive   OMP_WAIT_POLICY=PASSIVE: sleep at once (spin count 0)
  active    OMP_WAIT_POLICY=ACTIVE: threads spin between ops for minutes
  torch1st  `import torch` before headwise, nothing set: libgomp's own default (spin 300000, ~3 ms)
  spin10k   GOMP_SPINCOUNT=10000; spinN: GOMP_SPINCOUNT=N, for any N
  llama     llama.cpp's `llama-bench -p 0 -n <new-tokens> -t <cores>` on the same GGUF file (its tg
            figure; built by benchmarks/peers/llama_cpp.py); llama1: the same at -t 1
Conditions: idle (whatever else runs on the machine) and busy (plus one `python -c "while 1: pass"`
spinning for the whole measurement). Rounds run every (condition, variant) once, in an order
rotated each round; min / median / max per cell; busy/idle = busy median / idle median, and the
claims' ratios round by round (min / median / max over the rounds).

    .venv/bin/python benchmarks/busy.py                # ~10 min on 2 cores; saves results/busy.txt
    .venv/bin/python benchmarks/busy.py --quick        # 1 round, 32 tokens, no save
    .venv/bin/python benchmarks/busy.py --same-process 20 --new-tokens 256   # claim 2 in one process

--same-process N: claim 2 without the fresh processes' spread (each one's memory placement moves its
speed by several percent, 0.79-1.06x between two of them on a quiet machine): one process loads the
model once and decodes N rounds governed (`default`) and N with the count pinned to the cores
(GOVERNOR.pin, as `fixed`), alternating which goes first; the paired ratio round by round.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
VARIANTS = {
    "default": {},  # headwise's choice: threads fitted to the free cores, GOMP_SPINCOUNT=2000
    "fixed": {"HEADWISE_THREADS": str(CORES)},  # the governor off: every core's thread
    "1thread": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "torch1st": {},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "llama": {},  # llama-bench -t <cores>
    "llama1": {},  # llama-bench -t 1
}
OURS = ("HEADWISE_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def child(variant: str, new_tokens: int) -> None:
    """Runs in the measured subprocess: print one JSON line with tokens/s."""
    if variant == "torch1st":
        import warnings
        import torch  # noqa: F401  before headwise: libgomp keeps its spinning default

        warnings.simplefilter("ignore")
    import headwise
    import torch

    if variant == "1thread":
        torch.set_num_threads(1)
    from headwise.runtime.threads import GOVERNOR

    model = headwise.load(MODEL)
    headwise.generate(model, PROMPT, max_new_tokens=16, temperature=0, ignore_eos=True)
    res = headwise.generate(model, PROMPT, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    print(
        json.dumps(
            {
                "tok_s": res.tokens_per_second,
                "threads": res.threads,
                "others": GOVERNOR.others,
                "tokens": len(res.token_ids),
            }
        ),
        flush=True,
    )


def same_process(rounds: int, new_tokens: int) -> None:
    """Runs in the measured subprocess: governed vs pinned decodes alternated in one process, one JSON line."""
    import headwise
    from headwise.runtime.threads import GOVERNOR

    model = headwise.load(MODEL)
    headwise.generate(model, PROMPT, max_new_tokens=16, temperature=0, ignore_eos=True)
    got: dict[str, list] = {"default": [], "fixed": [], "threads": [], "others": []}
    for r in range(rounds):
        for var in ("default", "fixed") if r % 2 == 0 else ("fixed", "default"):
            GOVERNOR.pin(CORES if var == "fixed" else None)
            res = headwise.generate(model, PROMPT, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
            got[var].append(res.tokens_per_second)
            if var == "default":
                got["threads"].append(res.threads)
                got["others"].append(round(GOVERNOR.others, 2))
    GOVERNOR.pin(None)
    print(json.dumps(got), flush=True)


def run_same_process(args, log) -> None:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "same-process", "--rounds", str(args.same_process)]
        + ["--new-tokens", str(args.new_tokens)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode:
        raise SystemExit(f"the same-process child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for r, (d, f) in enumerate(zip(got["default"], got["fixed"])):
        log(
            f"  round {r + 1}: default {d:7.2f} tok/s ({got['threads'][r]} threads, others {got['others'][r]:.2f} "
            f"cores)  fixed {f:7.2f} tok/s  default/fixed {d / f:.3f}"
        )
    log(f"load average (1 min) {load0:.2f} -> {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s in all")
    log(
        f"default idle {statistics.median(got['default']):.2f} tok/s (median), fixed idle "
        f"{statistics.median(got['fixed']):.2f}"
    )
    log(
        "claim 2, quiet speed unchanged (>= 0.98x), one process: default / fixed, round by round "
        + ratios(got["default"], got["fixed"])
    )


def variant_env(variant: str) -> dict:
    """A named variant, or spinN: libgomp spins N rounds before sleeping (GOMP_SPINCOUNT=N)."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    m = re.fullmatch(r"spin(\d+)", variant)
    if not m:
        raise SystemExit(f"unknown variant {variant!r}: choose {', '.join(VARIANTS)} or spinN (N spin rounds)")
    return {"GOMP_SPINCOUNT": m.group(1)}


def llama_tg(variant: str, new_tokens: int) -> dict:
    """llama-bench's decode (tg) on the GGUF file headwise loads, one timed run after its warm-up."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import llama_cpp

    from headwise.models.builtin import resolve

    threads = 1 if variant == "llama1" else CORES
    res = llama_cpp.llama_bench(resolve(MODEL), threads, n_prompt=0, n_gen=new_tokens, reps=1)
    return {"tok_s": res["tg"], "threads": threads, "others": None, "libgomp": f"llama-bench -t {threads}"}


def measure(variant: str, busy: bool, new_tokens: int, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(variant_env(variant), OMP_DISPLAY_ENV="VERBOSE")
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
    try:
        if variant.startswith("llama"):
            return llama_tg(variant, new_tokens)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--new-tokens", str(new_tokens)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode:
        raise RuntimeError(f"{variant} child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    policy = re.search(r"OMP_WAIT_POLICY = '(\w+)'", proc.stderr)
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    # libgomp prints an unset policy as PASSIVE too: the spin count is what tells them apart
    out["libgomp"] = f"{policy.group(1) if policy else '?'}, GOMP_SPINCOUNT={spin.group(1) if spin else '?'}"
    return out


def cpu_summary() -> str:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, ISA: {' '.join(isa) or 'no AVX2'}"


def llama_built() -> bool:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import llama_cpp

    try:
        return llama_cpp.tool("llama-bench").exists()
    except (OSError, RuntimeError, SystemExit):
        return False


def ratios(num: list[float], den: list[float]) -> str:
    """num[r] / den[r] round by round: median (min-max)."""
    rs = [a / b for a, b in zip(num, den) if b]
    return f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f}, {len(rs)} rounds)" if rs else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of " + ", ".join(VARIANTS) + ", or spinN (GOMP_SPINCOUNT=N); "
        "default: default,fixed,1thread (+ llama,llama1 where llama.cpp is built)",
    )
    p.add_argument("--conditions", default="idle,busy", help="idle, busy or both")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="1 round, no save")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "busy.txt"))
    p.add_argument(
        "--same-process",
        type=int,
        default=0,
        metavar="N",
        help="claim 2 only: N rounds of governed vs pinned decodes in one process (see above)",
    )
    args = p.parse_args()
    if args.child == "same-process":
        same_process(args.rounds, args.new_tokens)
        return 0
    if args.child:
        child(args.child, args.new_tokens)
        return 0
    if args.quick:
        args.rounds = 1
    if args.variants is None:
        args.variants = "default,fixed,1thread" + (",llama,llama1" if llama_built() else "")
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS and not re.fullmatch(r"spin\d+", v)]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    lines: list[str] = []

    def log(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    conditions = [c.strip() for c in args.conditions.split(",")]
    if not set(conditions) <= {"idle", "busy"} or not conditions:
        p.error(f"--conditions takes idle and/or busy, got {args.conditions!r}")
    cells = [(c, v) for c in conditions for v in variants]
    log(
        f"busy: headwise.generate decode tok/s, {MODEL} (Q4_1 GGUF as loaded), greedy, {args.new_tokens} new "
        + (
            f"tokens, {args.same_process} rounds governed vs pinned, alternated in one process"
            if args.same_process
            else f"tokens, {args.rounds} interleaved rounds, fresh process each"
        )
    )
    log(f"date {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}; {cpu_summary()}")
    log(f"python {platform.python_version()}; command: {' '.join(['python', *sys.argv])}")
    if args.same_process:
        run_same_process(args, log)
        if not args.quick:
            Path(args.out).write_text("\n".join(lines) + "\n")
            print(f"saved {args.out}")
        return 0
    samples: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    seen: dict[tuple[str, str], str] = {}
    loads = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    for r in range(args.rounds):
        k = r % len(cells)
        for cond, var in cells[k:] + cells[:k]:
            res = measure(var, cond == "busy", args.new_tokens, args.timeout)
            samples[cond, var].append(res["tok_s"])
            seen[cond, var] = f"{res['libgomp']}, {res['threads']} threads"
            loads.append(os.getloadavg()[0])
            others = f"others {res['others']:.2f} cores; " if res.get("others") is not None else ""
            log(
                f"  round {r + 1}: {cond:4s} {var:9s} {res['tok_s']:7.2f} tok/s  ({seen[cond, var]}; {others}"
                f"load {loads[-1]:.2f})"
            )
    log(
        f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}, median "
        f"{statistics.median(loads):.2f}; {time.perf_counter() - t_start:.0f} s in all"
    )
    log()

    def cell(s: list[float]) -> str:
        return f"{statistics.median(s):7.2f} ({min(s):.1f}-{max(s):.1f})" if s else "-"

    header = (
        f"{'variant':9s}  {'took (last run)':46s}  {'idle tok/s (min-max)':>22s}  {'busy tok/s (min-max)':>22s}  "
        "busy/idle"
    )
    log(header)
    log("-" * len(header))
    for var in variants:
        idle, busy = samples.get(("idle", var), []), samples.get(("busy", var), [])
        ratio = f"{statistics.median(busy) / statistics.median(idle):8.2f}x" if idle and busy else "-"
        took = seen.get(("busy", var)) or seen.get(("idle", var))
        log(f"{var:9s}  {took:46s}  {cell(idle):>22s}  {cell(busy):>22s}  {ratio:>9s}")
    log()
    n = CORES
    log(
        f"busy/idle = busy median / idle median. One extra busy process takes one of the {n} cores: its fair "
        f"share leaves ~{max(n - 1, 1) / n:.2f}x."
    )
    have = {key for key, s in samples.items() if s}
    if {("idle", "default"), ("busy", "default")} <= have:
        log(
            "claim 1, decode beside one busy process >= 0.45x alone: default busy / default idle, round by round "
            + ratios(samples["busy", "default"], samples["idle", "default"])
        )
    if {("idle", "default"), ("idle", "fixed")} <= have:
        log(
            "claim 2, quiet speed unchanged (>= 0.98x): default idle / fixed idle, round by round "
            + ratios(samples["idle", "default"], samples["idle", "fixed"])
        )
    for var in ("llama", "llama1"):
        if {("idle", var), ("busy", var)} <= have:
            log(f"llama.cpp ({var}) busy / idle, round by round " + ratios(samples["busy", var], samples["idle", var]))
    if not args.quick:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
