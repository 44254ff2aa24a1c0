"""Which 16-bit K/V the decode kernels read fastest here, and what 16-bit K/V cost or save a decode.

Part 1, the kernel: headwise.kernels.attention.decode_attention over SmolLM2-135M's heads (Hkv=3,
G=3, D=64) with K/V stored as fp32, bf16 and fp16, C sequences of S keys; "cold": 30 pools in turn
(30 layers' worth, beyond the caches, as a real decode step reads them). Part 2, a whole decode:
the engine on SmolLM2-135M's stored Q4_1 weights, one sequence decoding after a prompt of P tokens,
with the KV pool in fp32, bf16 and fp16 (tokens/s). Each part interleaves its contenders round by
round (benchmarks/_common.py time_interleaved) and reports min / median / max and the paired ratio
(the median over rounds of fp32's time / its time).

    .venv/bin/python benchmarks/kv16.py                 # both parts (~3 min); --threads 1 on a busy box
    .venv/bin/python benchmarks/kv16.py --quick         # fewer shapes and rounds
    HEADWISE_ISA=avx2 .venv/bin/python benchmarks/kv16.py --no-engine   # the avx2 variant's kernel

runtime/config.py's DEFAULT_KV16 records the choice per kernel variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import Log, cpu_isa, cpu_model, loadavg, paired_candidates, rotated, summarize, table  # noqa: E402
import headwise  # noqa: E402
import headwise.kernels  # noqa: E402
import torch  # noqa: E402  (after headwise: its thread settings first)
from headwise.kernels.attention import decode_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEADERS = ["shape", "kv", "min ms", "median ms", "max ms", "fp32/it", "paired"]


def kernel_part(shapes, rounds: int, log: Log) -> list:
    lines = []
    for C, S in shapes:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(C, 3, 3, 64, generator=g)
        lengths = torch.full((C,), S, dtype=torch.int64)
        pools = {name: [] for name in DTYPES}
        for _ in range(30):
            k, v = torch.randn(2, C, 3, S, 64, generator=g)
            for name, dt in DTYPES.items():
                pools[name].append((k.to(dt), v.to(dt)))

        def run(name):
            def f():
                for k, v in pools[name]:
                    decode_attention(q, k, v, lengths, 0.125)

            return f

        _, rows = paired_candidates({n: run(n) for n in DTYPES}, "fp32", rounds, [f"C={C} S={S} x30"])
        lines += rows
        log(table(HEADERS, rows))
    return lines


def engine_part(prompt: int, tokens: int, rounds: int, log: Log) -> list:
    """Decode seconds only (the steps after the prefill's), interleaved round by round."""
    model = headwise.load("smollm2-135m-instruct")  # the stored Q4_1 weights
    ids = torch.randint(100, 40000, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    params = headwise.SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    engines = {
        name: headwise.Engine(model, max_num_seqs=1, num_blocks=(prompt + tokens) // 16 + 2, kv_dtype=kv)
        for name, kv in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))
    }

    def decode_seconds(engine) -> float:
        engine.add_request(ids, params)
        engine.step()  # the prefill (and the first token)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    names = list(engines)
    for name in names:
        decode_seconds(engines[name])  # warm-up
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            times[name].append(decode_seconds(engines[name]))
    rows = []
    for name in names:
        s = summarize([t * 1e3 for t in times[name]])
        paired = statistics.median(b / x for b, x in zip(times["fp32"], times[name]))
        ratio = statistics.median(times["fp32"]) / statistics.median(times[name])
        rows.append([f"engine P={prompt} +{tokens - 1}", name, f"{s['min']:.1f}", f"{s['median']:.1f}",
                     f"{s['max']:.1f}", f"{ratio:.3f}x", f"{paired:.3f}x",
                     f"{(tokens - 1) / (s['median'] / 1e3):.1f}"])  # fmt: skip
    log(table([*HEADERS, "median tok/s"], rows))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="the kernel part only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = Log()
    variant = headwise.kernels.isa()  # HEADWISE_ISA=avx2 runs the avx2 variant on an AVX-512 CPU
    log(f"{cpu_model()} ({cpu_isa()}), kernels {variant}, {torch.get_num_threads()} threads, load average {loadavg()}")
    shapes = [(1, 4096), (16, 512)] if args.quick else [(1, 1024), (1, 4096), (16, 512), (16, 2048)]
    kernel_part(shapes, 5 if args.quick else 11, log)
    if not args.no_engine:
        engine_part(512 if args.quick else 2048, 32 if args.quick else 64, 3 if args.quick else 7, log)
    log(f"load average at the end {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
