"""One claim: prefill_attention.c runs a causal prefill faster with 64 query tokens per block than
with 16 (the first tuning), on the shapes our models run.

Per shape, the prefill kernel (`attend(..., backend="prefill")`, fp32, causal, GQA grouped) is
called with each candidate block (the extension's `prefill_query_block`, the most it takes: the
kernel takes fewer where the blocks would not give every thread two), interleaved and rotated
round by round (benchmarks/_common.py), on the same q, k, v. The outputs of every candidate must
be 16's bit for bit (a row's keys meet it in the same blocks, whatever its query block).
Shapes: SmolLM2-135M (H 9, Hkv 3, D 64) and a Llama-style 32 / 8 x 128, T = S.
Reported: ms min / median / max per candidate, 16 / candidate of the medians and paired (the
median over rounds of that round's ratio).

    .venv/bin/python benchmarks/prefill_query_block.py      # ~3 min; results/prefill_query_block.{txt,json}
    .venv/bin/python benchmarks/prefill_query_block.py --lengths 512 --blocks 16,64 --rounds 5 --out /tmp/pq
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, paired_candidates, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise import kernels  # noqa: E402
from headwise.attention import attend  # noqa: E402

MODELS = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}  # H, Hkv, D
BASE = 16  # the first tuning, which the others are paired against


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048", help="T = S (default 128,512,2048)")
    ap.add_argument("--models", default="smollm2,llama-8b", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--blocks", default="16,32,64,128", help="query tokens per block to try (default 16,32,64,128)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_query_block")
    args = ap.parse_args(argv)
    lengths = [int(t) for t in args.lengths.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    if BASE not in blocks:
        blocks.insert(0, BASE)
    if min(blocks) < 1 or max(blocks) > 256:
        print("--blocks: 1 to 256 query tokens", file=sys.stderr)
        return 2
    mod, why = kernels._ext()
    if mod is None:
        print(f"the prefill kernel cannot run here: {why}", file=sys.stderr)
        return 2
    picked = mod.prefill_query_block(-1)
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    log(
        f"prefill_attention.c query tokens per block, causal fp32, {args.threads} threads, {args.rounds} rounds; "
        f"{env['date']}, torch {env['torch']}, {env['cpu_model']}, kernel variant {kernels.isa()}; default {picked}"
    )
    results, lines = {}, []
    load0, ticks0 = loadavg(), cpu_ticks()
    try:
        with torch.inference_mode():
            for name in args.models.split(","):
                H, Hkv, D = MODELS[name]
                for T in lengths:
                    g = torch.Generator().manual_seed(T)
                    q = torch.randn(1, H, T, D, generator=g)
                    k, v = (torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))

                    def run(pq, q=q, k=k, v=v):
                        mod.prefill_query_block(pq)
                        return attend(q, k, v, is_causal=True, backend="prefill")

                    fns = {str(pq): (lambda pq=pq: run(pq)) for pq in blocks}
                    outs = {b: fn() for b, fn in fns.items()}
                    for b, out in outs.items():
                        assert torch.equal(out, outs[str(BASE)]), f"{name} T={T}: block {b} differs from {BASE}"
                    timed, shape_lines = paired_candidates(fns, str(BASE), args.rounds, [name, T])
                    res = {pq: timed[str(pq)] for pq in blocks}
                    lines += shape_lines
                    results.setdefault(name, {})[T] = res
                    best = max(blocks, key=lambda b: res[b]["paired_vs_base"])
                    print(f"  {name} T={T}: best {best} ({res[best]['paired_vs_base']:.3f}x of {BASE})", flush=True)
    finally:
        mod.prefill_query_block(picked)
    log(f"ms per call (min / median / max over rounds); load {load0} -> {loadavg()}, "
        f"{busy_and_steal(ticks0, cpu_ticks())}")  # fmt: skip
    headers = ["shape", "T", "block", "min ms", "median", "max", f"vs {BASE} (medians)", f"vs {BASE} (paired)"]
    log(table(headers, lines))
    score = {
        b: statistics.geometric_mean([results[m][T][b]["paired_vs_base"] for m in results for T in results[m]])
        for b in blocks
    }
    log("geometric mean of the paired ratios: " + ", ".join(f"{b}: {v:.3f}x" for b, v in score.items()))
    log(f"fastest here: {max(score, key=score.get)} query tokens per block; the kernel's default: {picked}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(
            json.dumps({"environment": env, "default": picked, "results": results, "score": score}, indent=1)
        )
        print(f"saved {args.out.with_suffix('.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
