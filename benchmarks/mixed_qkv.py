"""One claim: a q|k|v whose stored formats cannot share one matrix (llama.cpp's Q4_K_M / Q5_K_M put V
in Q6_K / Q8_0 beside Q4_K / Q5_1 Q and K in about half the layers) decodes at least as fast held as
three quantized linears (MultiHeadAttention.unfuse, inside the one-call decoder stack) as it did
dequantized into one fp32 matrix (what headwise did before), with a fraction of the bytes.

The file: the builtin SmolLM2 requantized by llama.cpp's llama-quantize (benchmarks/peers/llama_cpp.py;
Q5_K_M by default: 14 of its 30 layers mix Q5_1 Q and K with a Q8_0 V). Both models load in this
process from that file; "fp32 fused" is the old load (the mixed q|k|v dequantized and fused). Each
round runs headwise.generate (greedy, 32-token prompt, 128 new tokens) on both, in an order rotated
round by round; reported: decode tok/s (GenerationResult.tokens_per_second) min / median / max, the
ratio of medians and the median of the rounds' ratios, and each model's weight bytes.

    .venv/bin/python benchmarks/mixed_qkv.py                 # ~1 min; results/mixed_qkv.{txt,json}
    .venv/bin/python benchmarks/mixed_qkv.py --type Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.models import loading  # noqa: E402
from headwise.models.builtin import resolve  # noqa: E402
from headwise.models.linear import weight_bytes  # noqa: E402
from peers import llama_cpp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q5_K_M", choices=llama_cpp.QUANT_TYPES, help="llama-quantize's type")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mixed_qkv")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    path = llama_cpp.quantize(resolve("smollm2"), args.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old load's "mix storage formats ... fp32" warning
        models = {"held apart": headwise.load(path)}
        old = loading._QKV
        loading._QKV = "(no name)"  # convert() then fuses a mixed q|k|v as fp32, as before
        try:
            models["fp32 fused"] = headwise.load(path)
        finally:
            loading._QKV = old
    apart = sum(not layer.attn.fused for layer in models["held apart"].layers)
    log(
        f"mixed q|k|v: {path.name}, {apart} of {len(models['held apart'].layers)} layers hold q, k, v apart; "
        f"{args.threads} threads, {args.rounds} rounds; {env['date']}, torch {env['torch']}, {env['cpu_model']}"
    )
    prompt = list(range(100, 132))
    rates: dict[str, list[float]] = {name: [] for name in models}
    load0, ticks0 = loadavg(), cpu_ticks()
    for r in range(args.rounds):
        for name in rotated(list(models), r):
            res = headwise.generate(models[name], prompt, max_new_tokens=128, temperature=0, ignore_eos=True)
            rates[name].append(res.tokens_per_second)
            log(f"  round {r + 1} {name}: {res.tokens_per_second:.1f} tok/s")
    load1, usage = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    base = rates["fp32 fused"]
    rows, results = [], {}
    for name, v in rates.items():
        s = summarize(v)
        paired = statistics.median(a / b for a, b in zip(v, base))
        wb = {k: round(n / 2**20, 1) for k, n in weight_bytes(models[name]).items()}
        results[name] = {"tok_s": s, "paired_vs_fp32_fused": paired, "weight_mib": wb}
        rows.append([name, f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}",
                     f"{s['median'] / statistics.median(base):.2f}x ({paired:.2f}x)",
                     f"{sum(wb.values()):.1f}", ", ".join(f"{k} {n}" for k, n in wb.items())])  # fmt: skip
    log(
        f"\ndecode tok/s, load {load0[0]} -> {load1[0]}, cpu busy {usage.get('busy_pct')}% steal {usage.get('steal_pct')}%:"
    )
    log(table(["q|k|v", "min", "median", "max", "vs fp32 fused (paired)", "weights MiB", "by format"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"env": env, "file": path.name, "load": [load0, load1], "usage": usage, "results": results}, indent=1
        )
    )
    args.out.with_suffix(".txt").write_text("\n".join(log.lines) + "\n")
    print(f"saved {args.out.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
