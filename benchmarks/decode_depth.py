"""One claim: batch-1 decode keeps llama.cpp's pace as the context fills, not only from an empty one.

tg128 (benchmarks/quantized.py) decodes from an empty cache, where attention is a few keys; a
chat turn or a document question decodes after hundreds or thousands of tokens. This runs both
at several depths on the same file and threads:

  hw_q       headwise.load("smollm2") (the GGUF's Q4_1 / Q8_0 blocks as stored): a prefill of
             `depth` random tokens into a contiguous cache (untimed), then `--new-tokens` greedy
             one-token steps, timed; tok/s = steps / time
  llama.cpp  llama-bench -p 0 -n <new-tokens> -d <depth> (its depth: the same tokens filled
             untimed first), one timed run per round (benchmarks/peers/llama_cpp.py builds it)

With --int8-kv, two more: hw_q_int8kv (the same with kv_dtype="int8": int8 K/V + an fp32 scale
per (token, head), 0.27x fp32's bytes, read by the decode kernel as int8) and llama.cpp_q8kv
(-ctk q8_0 -ctv q8_0 -fa on: its 8-bit cache, 0.53x its default f16's bytes).

Contenders alternate within each round and the order rotates round by round; min/median/max over
the rounds and the paired ratio (median over rounds of hw_q / llama.cpp in the same round).
A step past ~900 keys was 20x slower before ffae7bb (a nested OpenMP team in the decode step):
this is the table that shows such a cliff.

    .venv/bin/python benchmarks/decode_depth.py                  # ~4 min; results/decode_depth.{txt,json}
    .venv/bin/python benchmarks/decode_depth.py --quick --no-llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.cache import ContiguousKVCache  # noqa: E402
from headwise.models.builtin import resolve  # noqa: E402
from headwise.runtime.config import kv_dtype_for  # noqa: E402

MODEL = "smollm2-135m-instruct"


def hw_rate(model, depth: int, new: int, kv_dtype: str | None = None) -> float:
    """Greedy one-token steps after `depth` tokens (prefilled untimed; at least one) -> steps/s. K/V
    stored as kv_dtype, or as generate() stores them (16-bit for quantized weights, as llama-bench's f16)."""
    cfg = model.config
    kv_dtype = kv_dtype or kv_dtype_for(None, model)
    ids = torch.randint(17, cfg.vocab_size, (1, max(depth, 1)), generator=torch.Generator().manual_seed(depth))
    with torch.inference_mode():
        cache = ContiguousKVCache(
            cfg.num_layers, 1, cfg.num_kv_heads, ids.shape[1] + new, cfg.head_dim, kv_dtype=kv_dtype
        )
        nxt = model(ids, cache.step(ids.shape[1], logits_indices=[ids.shape[1] - 1])).argmax(-1).view(1, 1)
        t0 = time.perf_counter()
        for _ in range(new):
            nxt = model(nxt, cache.step(1))[:, -1].argmax(-1, keepdim=True)
        return new / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="a GGUF file instead of the builtin SmolLM2 (e.g. synthetic_gguf.py's)")
    ap.add_argument("--depths", default="0,512,1024,2048,4096", help="tokens in the context before decoding")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (not built here)")
    ap.add_argument("--int8-kv", action="store_true", help="also both with 8-bit K/V caches (see above)")
    ap.add_argument("--quick", action="store_true", help="depths 0,1024, 16 tokens, 1 round, nothing saved")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_depth")
    args = ap.parse_args()
    if args.quick:
        args.depths, args.new_tokens, args.rounds = "0,1024", 16, 1
    depths = [int(d) for d in args.depths.split(",")]
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    path = args.gguf or resolve(MODEL)
    log(f"headwise decode-at-depth benchmark  {env['date']}")
    log(f"torch {torch.__version__}  cpu {env['cpu_model']}  threads {args.threads}  kernels {headwise.kernels.isa()}")
    log(f"file {path.name}; {args.new_tokens} timed steps per run; depths {depths}; rounds {args.rounds}")
    model = headwise.load(str(path) if args.gguf else MODEL)
    log(f"K/V stored as {kv_dtype_for(None, model) or 'float32'} (generate()'s default; llama-bench: f16)")
    llama = None
    if not args.no_llama:
        from peers import llama_cpp  # `python benchmarks/peers/llama_cpp.py build` first

        llama = llama_cpp
        log(f"llama.cpp: {llama_cpp.build_info().get('version_output', '')[:120]}")
    names = ["hw_q", *(["llama.cpp"] if llama else [])]
    if args.int8_kv:
        names += ["hw_q_int8kv", *(["llama.cpp_q8kv"] if llama else [])]
    got = {d: {n: [] for n in names} for d in depths}
    hw_rate(model, 64, 8)  # warm-up: first-call costs
    l0, t0 = loadavg(), cpu_ticks()
    for r in range(args.rounds):
        for d in depths:
            for n in rotated(names, r):
                if n.startswith("hw_q"):
                    kv = "int8" if n.endswith("int8kv") else None
                    got[d][n].append(hw_rate(model, d, args.new_tokens, kv))
                else:
                    ct = "q8_0" if n.endswith("q8kv") else None
                    res = llama.llama_bench(
                        path, args.threads, n_prompt=0, n_gen=args.new_tokens, reps=1, n_depth=d, cache_type=ct
                    )
                    got[d][n].append(res["tg"])
            log(f"round {r + 1}/{args.rounds} depth {d}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in got[d].items()))
    l1, stat = loadavg(), busy_and_steal(t0, cpu_ticks())
    log(f"load {l0[0]:.2f} -> {l1[0]:.2f}, cpu busy {stat['busy_pct']:.1f}% steal {stat['steal_pct']:.1f}%")

    rows = []
    for d in depths:
        for n in names:
            s = summarize(got[d][n])
            ratio = paired = ""
            if llama:
                ref = got[d]["llama.cpp_q8kv" if n.endswith("kv") else "llama.cpp"]  # 8-bit caches vs each other
                ratio = f"{s['median'] / statistics.median(ref):.2f}x"
                paired = f"{statistics.median([a / b for a, b in zip(got[d][n], ref)]):.2f}x"
            rows.append([d, n, f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}", ratio, paired])
    log("")
    log(f"Batch-1 decode tok/s after `depth` tokens ({args.new_tokens} steps, {args.rounds} rounds)")
    log(table(["depth", "contender", "min", "median", "max", "vs llama.cpp (same cache bits)", "paired"], rows))
    if args.quick:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(log.text())
    args.out.with_suffix(".json").write_text(
        json.dumps({"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "tok_s": got}, indent=1)
    )
    log(f"saved {args.out.with_suffix('.txt')}/.json")


if __name__ == "__main__":
    main()
