"""How far ahead the small-row kernel should prefetch its weights: the claim behind
`kernels.cpu.PREFETCH_AHEAD_BY_CPU`.

From 5 rows, kernels/small_linear.c computes tiles of 12 (6 in the AVX2 build) rows over 128
inputs at a time, each weight panel read from memory once for all rows; the first row group of a
chunk also asks for the weights `prefetch_ahead` inputs on, so that memory keeps streaming while
the FMAs run. Too near and the lines arrive late; too far and they are evicted before use. The
best distance depends on the core (it was tuned to 128 on an AMD EPYC Zen 4; Zen 5 wants less),
so kernels/__init__.py sets it at load from the CPU's vendor and family.

This script times the kernel at each candidate distance on SmolLM2-135M's 30 layers of linear
shapes (425 MB of fp32, streamed from memory as in a decode step) and on its lm_head
(49152 x 576), at the engine's batch sizes, interleaved round by round, and prints each distance's
time and its paired ratio to 128 (the median over rounds of that round's 128 time / its time).
The outputs are checked bit-identical across distances (a prefetch changes no arithmetic).

With --quant, the same for kernels/quant_linear.c's packed groups (SmolLM2's GGUF: Q4_1 layers,
a Q8_0 lm_head; and one Llama-2-7B layer in Q4_K, whose long rows make long groups), which prefetch
a distance in bytes (`kernels.cpu.QUANT_PREFETCH_AHEAD_BY_CPU`) at every row count, paired against
2048.

Each group's weights are held in as many copies as make twice the CPU's L3 (--in-cache: once), so
that a pass streams them from DRAM as a decode step of a model larger than the cache does: on an
Intel Xeon with a 480 MiB L3 (2026-12-04) SmolLM2's weights alone stayed in cache, the distance
they picked (8 KiB) lost 14% on a 7B-shaped model, and 16 KiB won both.

    .venv/bin/python benchmarks/prefetch.py                     # ~5 min; results/prefetch.{txt,json}
    .venv/bin/python benchmarks/prefetch.py --rows 16 --distances 128,64,48 --rounds 5 --out /tmp/pf
    .venv/bin/python benchmarks/prefetch.py --quant             # results/prefetch_quant.{txt,json}
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
from headwise.kernels import quant  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
LAYERS = 30
HEAD = (49152, 576)  # SmolLM2's tied lm_head
# one Llama-2-7B layer (q, k, v, o, gate, up, down): --quant's "llama7b" group, in Q4_K, where rows of
# 4096 inputs make each packed group 18 KiB long (SmolLM2's Q4_1 rows: 2.5 KiB)
SHAPES_7B = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
QUANT_FORMAT = {"layers": "q4_1", "lm_head": "q8_0", "llama7b": "q4_k"}
BASE = 128  # the distance tuned first (AMD EPYC Zen 4), which the others are paired against
QUANT_BASE = 2048  # quant_linear.c's, in bytes (tuned on AMD EPYC Zen 3 / 4)


class Kind:
    """What is timed: the fp32 kernel (distance in inputs) or the quantized one (in bytes)."""

    def __init__(self, quant: bool):
        self.quant = quant
        self.base = QUANT_BASE if quant else BASE
        self.unit = "bytes" if quant else "inputs"
        self.name = "quantized kernel (Q4_1 layers, Q8_0 lm_head)" if quant else "small-row fp32 kernel"

    def setter(self, mod):
        return mod.quant_prefetch_ahead if self.quant else mod.prefetch_ahead

    def plans(self, weights, group, min_bytes: int):
        """Plans of the group's weights in the kernel's layout, the whole set repeated (copies in
        memory, not the same bytes) until it holds `min_bytes`: a pass then streams its weights
        from DRAM as a decode step does, however large the L3. -> (plans, copies, bytes of one set)."""
        if self.quant:
            fmt = QUANT_FORMAT[group]
            held = [quant.pack_rows(quant.quantize(w, fmt), fmt, *w.shape) for w in weights]
            size = sum(b.numel() for b in held)

            def make(i, c):
                return quant.plan_quant(held[i] if c == 0 else held[i].clone(), fmt, *weights[i].shape, packed=True)
        else:
            size = sum(4 * w.numel() for w in weights)

            def make(i, c):
                return kernels.plan_linear(kernels.block_weight(weights[i]), weights[i].shape[0])

        copies = max(1, -(-min_bytes // size))
        return [make(i, c) for c in range(copies) for i in range(len(weights))], copies, size

    def run(self, plan, x):
        return quant.run_quant(plan, x) if self.quant else kernels.run_linear(plan, x)


def l3_bytes() -> int:
    """This CPU's L3 size (cpu0's, from sysfs); 32 MiB where Linux does not say."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 32 << 20
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", action="store_true", help="time quant_linear.c's distance (bytes) instead")
    ap.add_argument("--rows", default=None, help="row counts (default 8,16,32 fp32, 5 to 64: the tiles that "
                    "prefetch; 1,4,8,16 --quant)")  # fmt: skip
    ap.add_argument("--distances", default=None, help="distances to try (default 128,96,64,48,32 inputs; "
                    "--quant: 2048,4096,8192,16384,32768 bytes)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--in-cache", action="store_true", help="one copy of each group's weights, which a large "
                    "L3 may hold (default: copies up to 2x the L3, so that they stream from DRAM)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="default results/prefetch[_quant]")
    args = ap.parse_args(argv)
    kind = Kind(args.quant)
    ref = kind.base
    rows = [int(r) for r in (args.rows or ("1,4,8,16" if args.quant else "8,16,32")).split(",")]
    distances = [
        int(d)
        for d in (args.distances or ("2048,4096,8192,16384,32768" if args.quant else "128,96,64,48,32")).split(",")
    ]
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / ("prefetch_quant" if args.quant else "prefetch")
    if ref not in distances:
        distances.insert(0, ref)
    if kernels.kernels_unavailable():
        print(f"the small-row kernel cannot run here: {kernels.kernels_unavailable()}", file=sys.stderr)
        return 2
    if max(rows) > kernels.KERNEL_ROWS or min(rows) < (1 if args.quant else 5):
        print(
            f"--rows: 5 to {kernels.KERNEL_ROWS} (fewer rows take the 4 x 8 tiles, which do not prefetch)",
            file=sys.stderr,
        )
        return 2
    limit = 65536 if args.quant else 4096
    if min(distances) < 0 or max(distances) > limit:
        print(f"--distances: 0 to {limit} {kind.unit}", file=sys.stderr)
        return 2
    mod, _ = kernels._ext()
    set_ahead = kind.setter(mod)
    picked = set_ahead(-1)
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    log(
        f"{kind.name} prefetch distance ({kind.unit}), SmolLM2-135M's {LAYERS} layers of linears and its lm_head, fp32, "
        f"{args.threads} threads, {args.rounds} rounds; {env['date']}, torch {env['torch']}, {env['cpu_model']}, "
        f"kernel variant {kernels.isa()}; this CPU's pick: {picked}"
    )
    g = torch.Generator().manual_seed(0)
    groups = {
        "layers": [torch.randn(O, I, generator=g) * 0.02 for _ in range(LAYERS) for O, I in SHAPES],
        "lm_head": [torch.randn(*HEAD, generator=g) * 0.02],
    }
    if args.quant:
        groups["llama7b"] = [torch.randn(O, I, generator=g) * 0.02 for O, I in SHAPES_7B]
    # SmolLM2's Q4_1 layers (62 MB) fit in some CPUs' L3 (480 MiB on an Intel Xeon, 2026-12-04), where
    # the pick they gave (8 KiB) lost 14% on a 7B model read from DRAM: copies up to twice the L3
    l3 = l3_bytes()
    min_bytes = 0 if args.in_cache else 2 * l3
    log(
        f"L3 {l3 / 2**20:.0f} MiB; each group's weights "
        + ("once" if args.in_cache else f"copied to >= {min_bytes / 2**20:.0f} MiB")
    )
    results, lines = {}, []
    load0, ticks0 = loadavg(), cpu_ticks()
    try:
        with torch.inference_mode():
            for group, weights in groups.items():
                plans, copies, size = kind.plans(weights, group, min_bytes)
                log(
                    f"  {group}: {len(weights)} matrices, {size / 2**20:.0f} MiB, x{copies} = {copies * size / 2**20:.0f} MiB"
                )
                for M in rows:
                    xs = [torch.randn(M, w.shape[1], generator=g) for w in weights] * copies

                    def run(d, plans=plans, xs=xs):
                        set_ahead(d)
                        return [kind.run(p, x) for p, x in zip(plans, xs)]

                    fns = {str(d): (lambda d=d: run(d)) for d in distances}
                    outs = {name: fn() for name, fn in fns.items()}
                    for name, out in outs.items():  # a prefetch changes no arithmetic: the same bits
                        assert all(torch.equal(a, b) for a, b in zip(out, outs[str(ref)])), name
                    timed, rows_lines = paired_candidates(fns, str(ref), args.rounds, [group, M])
                    res = {d: timed[str(d)] for d in distances}
                    lines += rows_lines
                    results.setdefault(group, {})[M] = res
                    best = max(distances, key=lambda d: res[d]["paired_vs_base"])
                    print(f"  {group} rows {M}: best {best} ({res[best]['paired_vs_base']:.3f}x of {ref})", flush=True)
    finally:
        set_ahead(picked)
    log(f"ms per pass over the group (min / median / max over rounds); load {load0} -> {loadavg()}, "
        f"{busy_and_steal(ticks0, cpu_ticks())}")  # fmt: skip
    headers = ["weights", "rows", "ahead", "min ms", "median", "max", f"vs {ref} (medians)", f"vs {ref} (paired)"]
    log(table(headers, lines))
    score = {d: statistics.geometric_mean([results[g][M][d]["paired_vs_base"] for g in results for M in rows])
             for d in distances}  # fmt: skip
    log("geometric mean of the paired ratios: " + ", ".join(f"{d}: {v:.3f}x" for d, v in score.items()))
    log(f"fastest here: {max(score, key=score.get)} {kind.unit}; this CPU's pick at load: {picked}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {"environment": env, "unit": kind.unit, "picked": picked, "results": results, "score": score}, indent=1
            )
        )
        print(f"saved {args.out.with_suffix('.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
