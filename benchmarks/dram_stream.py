"""Issue 42: what makes a 7B-shaped decode step stream its weights faster from DRAM, one knob at a time.

Llama-2-7B's layer (q, k, v, o, gate, up, down: 4096 x 4096 and 11008 x 4096 rows) in Q4_K, packed as
headwise loads it (kernels.quant.pack_rows), copied until a pass holds >= --min-mib (default 4x the L3, so
every pass reads DRAM as a 3.6 GiB token does), then run_quant at 1 row of x (a batch-1 decode step) over
every matrix in turn. Variants, timed interleaved round by round against `base` (paired: the median
over rounds of base's time / the variant's, benchmarks/_common.py):

  base        the weights in 2 MiB pages (kernels/hugepages.py), this CPU's prefetch distance and hint
  4k          the same bytes in 4 KiB pages (torch.empty)
  pf<N>       base with the prefetch distance N bytes (kernels.cpu.quant_prefetch_ahead_for)
  t0, nta     base with the K-quant tiles' prefetch hint the other way (kernels.cpu.quant_prefetch_nta_for)

The outputs are checked equal across variants (pages and prefetches change no arithmetic).

    .venv/bin/python benchmarks/dram_stream.py                             # ~1 min
    .venv/bin/python benchmarks/dram_stream.py --distances 2048,8192,16384 --rows 1,4 --rounds 21
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, paired_candidates, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise import kernels  # noqa: E402
from headwise.kernels import quant  # noqa: E402
from prefetch import SHAPES_7B, l3_bytes  # noqa: E402


def anon_huge_mib() -> int:
    """This process's memory in transparent huge pages, MiB (/proc/self/smaps_rollup)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="q4_k")
    ap.add_argument("--rows", default="1", help="rows of x (default 1: batch-1 decode)")
    ap.add_argument("--distances", default="", help="prefetch distances to try beside this CPU's (bytes)")
    ap.add_argument("--no-4k", action="store_true", help="skip the 4 KiB-page variant")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-mib", type=int, default=0, help="bytes a pass streams (default 4x the L3)")
    ap.add_argument("--out", type=Path, default=None, help="save <out>.txt / .json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    mod, _ = kernels._ext()
    picked, nta = mod.quant_prefetch_ahead(-1), mod.quant_prefetch_nta(-1)
    log, env = Log(), environment()
    g = torch.Generator().manual_seed(0)
    blocks = [quant.quantize(torch.randn(O, I, generator=g) * 0.02, args.fmt) for O, I in SHAPES_7B]
    size = sum(b.numel() for b in blocks)
    min_bytes = (args.min_mib << 20) or 4 * l3_bytes()
    copies = max(1, -(-min_bytes // size))

    def packed_plans(huge: bool):
        plans = []
        for _ in range(copies):
            for b, (O, I) in zip(blocks, SHAPES_7B):
                p = quant.pack_rows(b, args.fmt, O, I)
                if not huge:
                    p = torch.empty_like(p).copy_(p)  # torch.empty: 4 KiB pages
                plans.append(quant.plan_quant(p, args.fmt, O, I, packed=True))
        return plans

    ahp0 = anon_huge_mib()
    huge = packed_plans(True)
    ahp1 = anon_huge_mib()
    small = None if args.no_4k else packed_plans(False)
    log(
        f"7B-shaped layer in {args.fmt}, packed: {size / 2**20:.0f} MiB x{copies} = {copies * size / 2**20:.0f} MiB a "
        f"pass; {args.threads} threads, {args.rounds} rounds; {env['date']}, {env['cpu_model']}, kernels {kernels.isa()}, "
        f"prefetch {picked} bytes ({'NTA' if nta else 'T0'}); huge pages: {ahp1 - ahp0} MiB of the 2 MiB-page copy"
    )
    lines, results = [], {}
    load0, ticks0 = loadavg(), cpu_ticks()
    try:
        with torch.inference_mode():
            for M in [int(r) for r in args.rows.split(",")]:
                xs = [torch.randn(M, I, generator=g) for _, I in SHAPES_7B] * copies

                def run(plans, d=picked, xs=xs, hint=nta):
                    mod.quant_prefetch_ahead(d), mod.quant_prefetch_nta(hint)
                    return [quant.run_quant(p, x) for p, x in zip(plans, xs)]

                fns = {"base": lambda: run(huge)}
                if small is not None:
                    fns["4k"] = lambda: run(small)
                for d in [int(d) for d in args.distances.split(",") if d]:
                    fns[f"pf{d}"] = lambda d=d: run(huge, d)
                fns["t0" if nta else "nta"] = lambda: run(huge, hint=1 - nta)
                outs = {name: fn() for name, fn in fns.items()}
                for name, out in outs.items():
                    assert all(torch.equal(a, b) for a, b in zip(out, outs["base"])), name
                res, rows = paired_candidates(fns, "base", args.rounds, [M])
                results[M], lines = res, lines + rows
    finally:
        mod.quant_prefetch_ahead(picked), mod.quant_prefetch_nta(nta)
    log(f"load {load0} -> {loadavg()}, {busy_and_steal(ticks0, cpu_ticks())}")
    log(table(["rows", "variant", "min ms", "median", "max", "vs base (medians)", "vs base (paired)"], lines))
    gbs = {M: size * copies / results[M]["base"]["ms"]["median"] / 1e6 for M in results}
    log("base streams " + ", ".join(f"{gb:.1f} GB/s at {M} rows" for M, gb in gbs.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
