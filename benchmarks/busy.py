"""One claim: a second busy process costs headwise.generate about its share of the cores, not 4-15x
(issue 12), without giving up speed on a quiet machine: OpenMP threads spin briefly, then sleep
(headwise/core/threads.py), instead of spinning ~3 ms (libgomp's default) or sleeping at once (PASSIVE).

Model: SmolLM2-135M-Instruct fp32 (`headwise.load("smollm2-135m-instruct")`), greedy, EOS ignored,
a short chat prompt, --new-tokens decode tokens after a 4-token warm-up generate. Every measurement
is a fresh subprocess (libgomp reads its environment once, when torch loads it), and reports
`GenerationResult.tokens_per_second` (decode only). The child runs with OMP_DISPLAY_ENV=VERBOSE, so
the wait policy and spin count libgomp itself took are read from its stderr, not assumed.

Variants (how the child starts):
  default   `import headwise` first, nothing set: what every user now gets (GOMP_SPINCOUNT=2000)
  passive   OMP_WAIT_POLICY=PASSIVE: sleep at once (spin count 0)
  active    OMP_WAIT_POLICY=ACTIVE: threads spin between ops for minutes
  torch1st  `import torch` before headwise, nothing set: libgomp's own default (spin 300000, ~3 ms),
            what headwise.generate, the CLI (but `serve`), chat, demo and Engine ran with before
  1thread   default + torch.set_num_threads(1)
  spin10k   GOMP_SPINCOUNT=10000; spinN: GOMP_SPINCOUNT=N, for any N
Conditions: idle (whatever else runs on the machine) and busy (plus one `python -c "while 1: pass"`
spinning for the whole measurement). Rounds run every (condition, variant) once, in an order
rotated each round; min / median / max per cell; slowdown = idle median / busy median.

    .venv/bin/python benchmarks/busy.py                # ~10 min on 2 cores; saves results/busy.txt
    .venv/bin/python benchmarks/busy.py --quick        # 1 round, 8 tokens, no save
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
VARIANTS = {
    "default": {},  # headwise's choice: GOMP_SPINCOUNT=2000 (headwise/core/threads.py)
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "torch1st": {},
    "1thread": {},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
}
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
    model = headwise.load("smollm2-135m-instruct")
    headwise.generate(model, PROMPT, max_new_tokens=4, temperature=0, ignore_eos=True)
    res = headwise.generate(model, PROMPT, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    print(
        json.dumps({"tok_s": res.tokens_per_second, "threads": torch.get_num_threads(), "tokens": len(res.token_ids)}),
        flush=True,
    )


def variant_env(variant: str) -> dict:
    """A named variant, or spinN: libgomp spins N rounds before sleeping (GOMP_SPINCOUNT=N)."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    m = re.fullmatch(r"spin(\d+)", variant)
    if not m:
        raise SystemExit(f"unknown variant {variant!r}: choose {', '.join(VARIANTS)} or spinN (N spin rounds)")
    return {"GOMP_SPINCOUNT": m.group(1)}


def measure(variant: str, busy: bool, new_tokens: int, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(variant_env(variant), OMP_DISPLAY_ENV="VERBOSE")
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
    try:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--variants",
        default="default,passive,torch1st,1thread",
        help="comma-separated subset of " + ", ".join(VARIANTS) + ", or spinN (GOMP_SPINCOUNT=N)",
    )
    p.add_argument("--conditions", default="idle,busy", help="idle, busy or both")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="1 round, 8 tokens, no save")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "busy.txt"))
    args = p.parse_args()
    if args.child:
        child(args.child, args.new_tokens)
        return 0
    if args.quick:
        args.rounds, args.new_tokens = 1, 8
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
        f"busy: headwise.generate tok/s, SmolLM2-135M fp32, greedy, {args.new_tokens} new tokens, "
        f"{args.rounds} interleaved rounds, fresh process each"
    )
    log(f"date {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}; {cpu_summary()}")
    log(f"python {platform.python_version()}; command: {' '.join(['python', *sys.argv])}")
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
            log(
                f"  round {r + 1}: {cond:4s} {var:9s} {res['tok_s']:6.2f} tok/s  ({seen[cond, var]}; "
                f"load {loads[-1]:.2f})"
            )
    log(
        f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}, median "
        f"{statistics.median(loads):.2f}; {time.perf_counter() - t_start:.0f} s in all"
    )
    log()

    def cell(s: list[float]) -> str:
        return f"{statistics.median(s):6.2f} ({min(s):.1f}-{max(s):.1f})" if s else "-"

    header = (
        f"{'variant':9s}  {'libgomp took':46s}  {'idle tok/s (min-max)':>22s}  {'busy tok/s (min-max)':>22s}  slowdown"
    )
    log(header)
    log("-" * len(header))
    for var in variants:
        idle, busy = samples.get(("idle", var), []), samples.get(("busy", var), [])
        slow = f"{statistics.median(idle) / statistics.median(busy):7.2f}x" if idle and busy else "-"
        took = seen.get(("idle", var)) or seen.get(("busy", var))
        log(f"{var:9s}  {took:46s}  {cell(idle):>22s}  {cell(busy):>22s}  {slow:>8s}")
    log()
    n = os.cpu_count() or 1
    log(
        f"slowdown = idle median / busy median. One extra busy process takes one of the {n} cores, so its "
        f"fair share is a slowdown of ~{n / max(n - 1, 1):.1f}x."
    )
    if not args.quick:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
