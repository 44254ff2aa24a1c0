"""One claim: every GGML format headwise computes from runs faster from its 8-row packed layout
(kernels.quant.pack_rows, what `headwise.load` keeps by default) than from the file's row-by-row
layout, at the rows of a decode step and of a prefill chunk, where the weights come from memory.

Per format and shape, the same random blocks (tests/kernels' generator: every byte random, the f16
scales finite) as rows and packed, enough distinct copies that one pass streams ~200 MB (so every
call reads its weight from DRAM, as a decode step does), each pass timed, the two layouts
interleaved and rotated round by round (benchmarks/_common.py). The packed outputs are checked
against the rows' first (the same integers; float sums in another order).
Shapes: SmolLM2-135M's (576 -> 1536 gate, 1536 -> 576 down) and a Llama-3-8B's (4096 -> 4096,
4096 -> 14336, 14336 -> 4096); the K-quants only where the input is a multiple of 256.
Reported: ms per call min / median / max, rows / packed of the medians and paired, GB/s of weight.

    .venv/bin/python benchmarks/packed_formats.py           # ~3 min; results/packed_formats.{txt,json}
    .venv/bin/python benchmarks/packed_formats.py --formats q4_k,q6_k --rows 1 --rounds 5 --out /tmp/pf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, paired_candidates, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise import kernels  # noqa: E402
from headwise.kernels import quant  # noqa: E402
from tests.kernels.test_quant_linear import random_blocks  # noqa: E402  (the tests' block generator)

SHAPES = {"smollm2": [(1536, 576), (576, 1536)], "llama-8b": [(4096, 4096), (14336, 4096), (4096, 14336)]}
STREAM_BYTES = 200e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(quant.PACKABLE), help=f"of {', '.join(quant.PACKABLE)}")
    ap.add_argument("--models", default="smollm2,llama-8b", help=f"shapes of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default="1,16", help="rows of x per call (default 1,16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packed_formats")
    args = ap.parse_args(argv)
    why = quant.quant_unavailable("q4_0")
    if why is not None:
        print(f"the quantized kernels cannot run here: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    log(
        f"rows vs 8-row packed layout, {args.threads} threads, {args.rounds} rounds; {env['date']}, "
        f"torch {env['torch']}, {env['cpu_model']}, kernel variant {kernels.isa()}"
    )
    lines, results = [], {}
    load0, ticks0 = loadavg(), cpu_ticks()
    for fmt in args.formats.split(","):
        values = quant.FORMATS[fmt][1]
        for model in args.models.split(","):
            for O, I in SHAPES[model]:
                if I % values:
                    continue
                blocks = random_blocks(fmt, O, I)
                copies = max(2, int(STREAM_BYTES // blocks.numel()))
                rows = [blocks.clone() for _ in range(copies)]
                plans = {
                    "rows": [quant.plan_quant(b, fmt, O, I) for b in rows],
                    "packed": [quant.plan_quant(quant.pack_rows(b, fmt, O, I), fmt, O, I, packed=True) for b in rows],
                }
                for M in (int(m) for m in args.rows.split(",")):
                    x = torch.randn(M, I, generator=torch.Generator().manual_seed(M))
                    want, got = (quant.run_quant(plans[k][0], x) for k in ("rows", "packed"))
                    scale = want.abs().max().item()
                    assert (got - want).abs().max().item() <= 1e-4 * scale, f"{fmt} {O}x{I}: layouts disagree"

                    def stream(layout, x=x):
                        for p in plans[layout]:
                            quant.run_quant(p, x)

                    fns = {k: (lambda k=k: stream(k)) for k in ("rows", "packed")}
                    timed, shape_lines = paired_candidates(fns, "rows", args.rounds, [fmt, f"{O}x{I}", M])
                    for line, k in zip(shape_lines, fns):  # per call, not per pass over the copies
                        ms = [timed[k]["ms"][s] / copies for s in ("min", "median", "max")]
                        line[4:7] = [f"{v:.3f}" for v in ms]
                        line.append(f"{blocks.numel() / (ms[1] / 1e3) / 1e9:.1f}")
                    lines += shape_lines
                    results.setdefault(fmt, {})[f"{O}x{I}x{M}"] = {
                        k: {"ms_per_call": {s: v / copies for s, v in timed[k]["ms"].items() if s != "n"}}
                        | {"paired_vs_rows": timed[k]["paired_vs_base"]}
                        for k in fns
                    }
                    print(f"  {fmt} {O}x{I} M={M}: packed {timed['packed']['paired_vs_base']:.2f}x rows", flush=True)
    log(f"ms per call (min / median / max over rounds); load {load0} -> {loadavg()}, "
        f"{busy_and_steal(ticks0, cpu_ticks())}")  # fmt: skip
    headers = ["format", "O x I", "rows of x", "layout", "min ms", "median", "max", "rows / it", "paired", "GB/s"]
    log(table(headers, lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
        print(f"saved {args.out.with_suffix('.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
