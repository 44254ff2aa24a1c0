"""The `prefill` backend's claim: its kernel computes a prefill's attention, causal or unmasked,
faster than PyTorch's fused SDPA (the backend `auto` picked before it) on the shapes our models
and the seed's layer run.

Per shape, one call of each contender, interleaved and rotated round by round
(benchmarks/_common.py), on the same q, k, v (fp32, GQA passed grouped; q, k, v views of one fused
QKV projection (B, T, (H + 2 Hkv) D), as the layer and the models hand them):
  prefill  kernels/prefill_attention.c through `attend(..., backend="prefill")`
  sdpa     F.scaled_dot_product_attention(is_causal=..., enable_gqa=True), through `backend="sdpa"`
  chunked  headwise's pure-PyTorch tiled online softmax (`backend="chunked"`), for scale
Shapes: SmolLM2-135M (H 9, Hkv 3, D 64), a Llama-style 32 / 8 x 128 and the seed's layer (B 4,
H 12, D 64), at T = S = 128, 512, 2048; causal (default), unmasked or both (--mask).
Reported: ms min / median / max per contender, sdpa / prefill of the medians and paired (the
median over rounds of that round's ratio), effective GFLOP/s (causal: half of 4 B H T S D).

    .venv/bin/python benchmarks/prefill_attention.py           # ~2 min; results/prefill_attention.{txt,json}
    .venv/bin/python benchmarks/prefill_attention.py --lengths 512 --rounds 5 --out /tmp/pa
    .venv/bin/python benchmarks/prefill_attention.py --models seed-layer --lengths 2048 --mask both --threads 1 --no-chunked --out /tmp/pa
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise.attention import attend  # noqa: E402
from headwise.kernels import prefill  # noqa: E402

MODELS = {"smollm2": (1, 9, 3, 64), "llama-8b": (1, 32, 8, 128), "seed-layer": (4, 12, 12, 64)}  # B, H, Hkv, D


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048", help="T = S (default 128,512,2048)")
    ap.add_argument("--models", default="smollm2,llama-8b", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-chunked", action="store_true", help="leave out the pure-PyTorch tiles")
    ap.add_argument("--mask", choices=("causal", "none", "both"), default="causal")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_attention")
    args = ap.parse_args(argv)
    if prefill.prefill_attention_unavailable():
        print(f"the prefill kernel cannot run here: {prefill.prefill_attention_unavailable()}", file=sys.stderr)
        return 2
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        print(f"--models: unknown {unknown}; choose from {list(MODELS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    log(
        f"prefill attention, mask {args.mask}, fp32, {args.threads} threads, {args.rounds} rounds; {env['date']}, "
        f"torch {env['torch']}, {env['cpu_model']}"
    )
    names = ["prefill", "sdpa"] + ([] if args.no_chunked else ["chunked"])
    lines, results = [], {}
    load0, ticks0 = loadavg(), cpu_ticks()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for model in args.models.split(","):
            B, H, Hkv, D = MODELS[model]
            for T in (int(t) for t in args.lengths.split(",")):
                for causal in {"causal": (True,), "none": (False,), "both": (False, True)}[args.mask]:
                    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)  # (B, T, (H + 2 Hkv) D)
                    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
                    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
                    k, v = (x.view(B, T, Hkv, D).transpose(1, 2) for x in (k, v))  # (B, Hkv, T, D)
                    fns = {n: (lambda n=n, c=causal: attend(q, k, v, is_causal=c, backend=n)) for n in names}
                    want = attend(q, k, v, is_causal=causal, backend="math")
                    for n, fn in fns.items():  # the same answer from each, or no timing
                        torch.testing.assert_close(fn(), want, atol=1e-4, rtol=1e-4)
                    times, _ = time_interleaved(fns, rounds=args.rounds)
                    s = {n: summarize([t * 1e3 for t in times[n]]) for n in names}
                    ratio = s["sdpa"]["median"] / s["prefill"]["median"]
                    paired = statistics.median(a / b for a, b in zip(times["sdpa"], times["prefill"]))
                    flops = 4 * B * H * T * T * D // (2 if causal else 1)  # 2 matmuls x 2 flops; causal half
                    mask = "causal" if causal else "none"
                    results[f"{model} T={T} {mask}"] = {"ms": s, "sdpa_over_prefill": ratio, "paired": paired}
                    lines.append(
                        [model, T, mask]
                        + [f"{s[n]['min']:.2f} / {s[n]['median']:.2f} / {s[n]['max']:.2f}" for n in names]
                        + [f"{ratio:.2f}x", f"{paired:.2f}x", f"{flops / s['prefill']['median'] / 1e6:.0f}"]
                    )
                    print(
                        f"  {model} T={T} {mask}: prefill {s['prefill']['median']:.2f} ms, "
                        f"sdpa {s['sdpa']['median']:.2f}",
                        flush=True,
                    )
    log(f"ms per call (min / median / max); load {load0} -> {loadavg()}, {busy_and_steal(ticks0, cpu_ticks())}")
    headers = ["model", "T = S", "mask", *names, "sdpa / prefill", "paired", "prefill GFLOP/s"]
    log(table(headers, lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
        print(f"saved {args.out.with_suffix('.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
