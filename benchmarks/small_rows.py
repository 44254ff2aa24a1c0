"""Where the small-row fp32 kernel stops beating oneDNN: the claim behind `kernels.MAX_ROWS`.

PackedLinear sends a forward of up to `kernels.MAX_ROWS` rows to kernels/small_linear.c (the
weight in 8-row blocks, 4 x 8 tiles up to 4 rows, from 5 rows 6 x 16 ymm tiles in the AVX2 build
and 12 x 32 zmm tiles in the AVX-512 one) and more rows to oneDNN's prepacked matmul. The engine's
decode steps are 1-64 rows, so this crossover sets its speed. It depends on the CPU: 16-wide
tiles pay where the core has full 512-bit FMA units (Intel Xeon, AMD Zen 5), not where it splits
a 512-bit FMA in two (AMD Zen 4). This script times both on SmolLM2-135M's 30 layers of linear shapes (qkv 960 x 576,
o 576 x 576, gate_up 3072 x 576, down 576 x 1536; 425 MB of fp32, streamed from memory as in a
decode step) at each row count, interleaved round by round, and prints the ratio and what
MAX_ROWS picks on this CPU.

    .venv/bin/python benchmarks/small_rows.py             # ~2 min; results/small_rows.{txt,json}
    .venv/bin/python benchmarks/small_rows.py --rows 1,16 --rounds 3 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise import kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
LAYERS = 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,5,8,16,32,64", help="row counts (default 1,2,4,5,8,16,32,64)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "small_rows")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if kernels.kernels_unavailable():
        print(f"the small-row kernel cannot run here: {kernels.kernels_unavailable()}", file=sys.stderr)
        return 2
    if max(rows) > kernels.KERNEL_ROWS or min(rows) < 1:
        print(f"--rows: 1 to {kernels.KERNEL_ROWS} (the kernel's limit)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    log(
        f"small-row kernel vs oneDNN, SmolLM2-135M's {LAYERS} layers of linears, fp32, {args.threads} threads, "
        f"{args.rounds} rounds; {env['date']}, torch {env['torch']}, {env['cpu_model']}, "
        f"PyTorch CPU capability {torch.backends.cpu.get_cpu_capability()}, kernel variant {kernels.isa()}"
    )
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(O, I, generator=g) * 0.02 for _ in range(LAYERS) for O, I in SHAPES]
    plans = [kernels.plan_linear(kernels.block_weight(w), w.shape[0]) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    results, lines = {}, []
    load0, ticks0 = loadavg(), cpu_ticks()
    with torch.inference_mode():
        for M in rows:
            xs = [torch.randn(M, w.shape[1], generator=g) for w in weights]
            fns = {
                "kernel": lambda: [kernels.run_linear(p, x) for p, x in zip(plans, xs)],
                "onednn": lambda: [
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p, x in zip(packed, xs)
                ],
            }
            y_k, y_o = fns["kernel"]()[-1], fns["onednn"]()[-1]
            torch.testing.assert_close(y_k, y_o, rtol=1e-4, atol=1e-4)  # the same product, both ways
            times, _ = time_interleaved(fns, rounds=args.rounds)
            s = {k: summarize([t * 1e3 for t in v]) for k, v in times.items()}
            ratio = s["onednn"]["median"] / s["kernel"]["median"]
            results[M] = {"kernel_ms": s["kernel"], "onednn_ms": s["onednn"], "onednn_over_kernel": ratio}
            picks = "kernel" if M <= kernels.MAX_ROWS else "onednn"
            lines.append(
                [
                    M,
                    *(f"{s[k][q]:.1f}" for k in ("kernel", "onednn") for q in ("min", "median", "max")),
                    f"{ratio:.2f}x",
                    "kernel" if ratio > 1 else "onednn",
                    picks,
                ]
            )
            print(
                f"  rows {M}: kernel {s['kernel']['median']:.1f} ms, oneDNN {s['onednn']['median']:.1f} ms", flush=True
            )
    use = busy_and_steal(ticks0, cpu_ticks())
    log(
        f"ms per step of all {len(weights)} linears (min / median / max over rounds); load {load0} -> {loadavg()}, {use}"
    )
    headers = ["rows", "kernel min", "median", "max", "oneDNN min", "median", "max", "oneDNN / kernel", "faster",
               f"MAX_ROWS={kernels.MAX_ROWS} picks"]  # fmt: skip
    log(table(headers, lines))
    wins = [M for M in rows if results[M]["onednn_over_kernel"] > 1]
    log(f"the kernel is faster at rows {wins or 'none'}; kernels.MAX_ROWS here = {kernels.MAX_ROWS}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(
            json.dumps({"environment": env, "max_rows": kernels.MAX_ROWS, "rows": results}, indent=1)
        )
        print(f"saved {args.out.with_suffix('.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
