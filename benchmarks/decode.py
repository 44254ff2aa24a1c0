"""One claim: headwise generates with SmolLM2-135M-Instruct faster than transformers on the same fp32 weights.

Model: headwise.load("smollm2-135m-instruct") (the builtin Q4_1 GGUF, dequantized to
fp32), and transformers' LlamaForCausalLM built from the very same tensors, once with
attn_implementation="sdpa" and once with "eager". CPU, inference only, greedy.

Decode: B in {1, 8} random prompts of 32 tokens each (same length: no padding), 128
new tokens, EOS ignored. Contenders:
  hw_generate       headwise.generate(..., temperature=0, ignore_eos=True); decode rate
                    from its own decode_seconds, end-to-end from the wall clock
  hw_loop           (diagnostic) the same steps by hand: model(ids, cache=) + argmax,
                    then 127 x (model(next, cache=) + argmax); no detokenizer, no sampler
  hw_general        (diagnostic) headwise.generate with the decoder block's few-rows route off
                    (headwise.models.blocks.ROUTE_ROWS = 0): every step takes the general route,
                    same linears (on a checkout without ROUTE_ROWS: models/fast_decode.py off)
  hw_no_kernel      (diagnostic) headwise.generate with the small-row C kernel switched off
                    (headwise/kernels): the few-rows route's matmuls through oneDNN-prepacked weights
  hw_unpacked       (diagnostic, prefill only) headwise.load(..., pack=False): plain nn.Linear
                    instead of the library's default oneDNN-prepacked linears
  hw_compiled       (--compile, on by default) headwise.generate(..., compile=True): the decode
                    step as one inductor graph (frozen weights, static cache); its first call
                    per batch size compiles, timed separately and reported
  hf_<impl>_generate  hf.generate(ids, attention_mask, do_sample=False, max_new_tokens=128,
                    min_new_tokens=128, pad_token_id=0): end-to-end only
  hf_<impl>_loop    out = hf(ids, use_cache=True), argmax, then 127 x hf(next,
                    past_key_values=..., use_cache=True) + argmax; prefill and decode timed apart
  floor             not a contender: only the weight matmuls of 127 steps (4 linears per
                    layer + the output layer), no norms, RoPE, attention, cache or Python
                    model code; hf / floor bounds any speed-up a faster model could show
  floor_packed      not a contender: the same matmuls through prepacked oneDNN weights
  floor_kernel      not a contender: the same matmuls through headwise.kernels.small_linear on
                    blocked weights (only for B <= kernels.MAX_ROWS)
Decode span (for every contender that has one): from after prefill's logits to the
128th token, i.e. 128 argmaxes and 127 one-token forwards, exactly what
generate() times; decode tok/s = B * 128 / that time. The claim compares decode
rates (hw_generate vs hf_sdpa_loop); end-to-end (hw_generate vs hf_sdpa_generate)
is reported next to it.

Memory-bandwidth limit (B=1): a one-token forward must read every fp32 weight once
(the tied 49152x576 output layer included, the embedding row lookup not counted
separately) plus the K/V cached so far (30 layers x 2 x 3 heads x 64 x 4 B per token
of context, 96 tokens on average over the 127 forwards). Copy bandwidth is measured in
the same run: a 512 MiB torch.Tensor.copy_, counting bytes read + written (write-
allocate traffic not counted, so the bound is, if anything, optimistic for the
machine). fraction = bytes a forward must read * forwards / decode time / bandwidth.

Prefill: one 512-token prompt, B=1, one forward returning all 512 x 49152 logits:
model(ids) vs hf(ids, use_cache=False).logits (and hw_unpacked, floor, floor_packed as above).
transformers 5.24 renamed forward's past_key_values to cache (the old name warns); the
loop passes whichever this version's LlamaForCausalLM.forward takes.

Greedy token ids must agree (headwise vs each HF path) before anything is timed; a
divergence is accepted only where it is explained (a near-tie of the two logits,
< TIE_TOL, or EOS, which hf.generate's min_new_tokens forbids), and is reported.
Contenders run interleaved in rotated order after warm-up (benchmarks/_common.py),
once per thread count in --threads (default 2,1: the machine is shared, and 2-thread
timings collapse when another process is busy; 1-thread comparisons are steadier).
Profiles: one decode step at B=1 after 32 tokens, torch.profiler (CPU), at 1 thread.

    .venv/bin/python benchmarks/decode.py              # full run, ~30-40 min; saves results/
    .venv/bin/python benchmarks/decode.py --quick      # smoke test (16 new tokens), nothing saved
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import (
    Log,
    busy_and_steal,
    cpu_ticks,
    environment,
    loadavg,
    summarize,
    table,  # noqa: E402
    time_interleaved,
)
import torch  # noqa: E402  (after _common: headwise first)
import headwise.models.blocks as blocks  # noqa: E402
from headwise import kernels  # noqa: E402
from headwise.models.packing import packing_available  # noqa: E402
from _contenders import (
    MODEL,
    PROMPT_LEN,
    SEED,
    TIE_TOL,
    BW_MIB,
    check_agreement,
    copy_bandwidth,  # noqa: E402
    floor_steps,
    floor_weights,
    hf_generate,
    hf_loop,
    hw_generate,
    hw_loop,
    load_models,
    make_prompts,
    model_bytes,
    try_compile,
    unpacked_model,
)
from _prefill import PREFILL_ATOL, prefill_table, run_prefill  # noqa: E402
from _profile import profile_text, run_profiles  # noqa: E402


# ------------------------------------------------------------------ decode cells
def run_decode(B: int, args, M: dict, mb, bw: float, log, check: bool) -> dict:
    """M: the models, {"hw", "hw_unpacked", "compile" (bool), "hf": {impl: model}, "floor",
    "floor_packed", "floor_kernel" (or None)}."""
    model = M["hw"]
    cfg = model.config
    ids = make_prompts(B, cfg.vocab_size)
    new = args.new_tokens
    calls = {"hw_generate": lambda: hw_generate(model, ids, new), "hw_loop": lambda: hw_loop(model, ids, new)}
    calls["hw_general"] = lambda: hw_generate(model, ids, new, off="few_rows")
    if kernels.kernels_unavailable() is None:
        calls["hw_no_kernel"] = lambda: hw_generate(model, ids, new, off="kernel")
    if M.get("compile"):
        calls["hw_compiled"] = lambda: hw_generate(model, ids, new, compile=True)
    for impl, m in M["hf"].items():
        calls[f"hf_{impl}_generate"] = lambda m=m: hf_generate(m, ids, new)
        calls[f"hf_{impl}_loop"] = lambda m=m: hf_loop(m, ids, new)
    for name in ("floor", "floor_packed", "floor_kernel"):
        if M.get(name) is not None and (name != "floor_kernel" or B <= kernels.MAX_ROWS):
            calls[name] = lambda w=M[name]: floor_steps(w, B, cfg.d_model, new - 1)

    agreement = None
    if check:
        outs = {n: fn()["ids"] for n, fn in calls.items() if not n.startswith("floor")}
        agreement = check_agreement(model, ids, outs, log)

    details: dict[str, list[dict]] = {n: [] for n in calls}

    def recorder(name):
        def run():
            details[name].append(calls[name]())

        return run

    load0, ticks0 = loadavg(), cpu_ticks()
    with torch.inference_mode():
        times, rounds = time_interleaved({n: recorder(n) for n in calls}, rounds=args.rounds, warmup=1)
    load1, cpu = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    details = {n: d[-rounds:] for n, d in details.items()}  # drop the warm-up calls
    ref_ids = details["hw_generate"][0]["ids"]
    unstable = [
        n for n, ds in details.items() if n in ("hw_generate", "hw_loop") and any(d["ids"] != ref_ids for d in ds)
    ]

    # bytes one forward must read: weights + the K/V of its context (32 + 1 .. 32 + 127)
    steps = new - 1
    ctx_mean = PROMPT_LEN + 1 + (steps - 1) / 2
    fwd_bytes = mb["weight_bytes"] + B * mb["kv_bytes_per_token"] * ctx_mean
    summary = {}
    for name, ds in details.items():
        s = {}
        if "decode_s" in ds[0]:
            rates = [B * new / d["decode_s"] for d in ds]
            s["decode_tok_s"] = summarize(rates)
            s["decode_bw_fraction"] = {
                k: fwd_bytes * steps / (B * new / s["decode_tok_s"][k]) / (bw * 1e9) for k in ("min", "median", "max")
            }
        s["e2e_tok_s"] = summarize([B * new / d["wall_s"] for d in ds])
        if "prefill_s" in ds[0]:
            s["prefill_ms"] = summarize([d["prefill_s"] * 1e3 for d in ds])
        summary[name] = s

    def ratio(a, b, key):
        return summary[a][key]["median"] / summary[b][key]["median"]

    for name, s in summary.items():
        if "decode_tok_s" in s:
            s["decode_vs_hf_sdpa_loop"] = ratio(name, "hf_sdpa_loop", "decode_tok_s")
            s["decode_vs_hf_sdpa_loop_paired"] = statistics.median(
                (B * new / a["decode_s"]) / (B * new / b["decode_s"])
                for a, b in zip(details[name], details["hf_sdpa_loop"])
            )
        s["e2e_vs_hf_sdpa_generate"] = ratio(name, "hf_sdpa_generate", "e2e_tok_s")
    for d in details.values():
        for x in d:
            x.pop("ids", None)
    brief = ", ".join(
        f"{n} {summary[n]['decode_tok_s']['median']:.1f}" for n in summary if "decode_tok_s" in summary[n]
    )
    log(
        f"  done decode B={B} rounds={rounds} load {load0[0]:.2f} -> {load1[0]:.2f}"
        + (f"  cpu busy {cpu['busy_pct']}% steal {cpu['steal_pct']}%" if cpu else "")
        + f"; median decode tok/s: {brief}"
    )
    return {
        "B": B,
        "prompt_len": PROMPT_LEN,
        "new_tokens": new,
        "rounds": rounds,
        "loadavg_before": load0,
        "loadavg_after": load1,
        **cpu,
        "forward_bytes_mean": fwd_bytes,
        "bandwidth_gb_s": bw,
        "bw_limit_tok_s": B * bw * 1e9 / fwd_bytes,
        "agreement": agreement,
        "hw_ids_unstable_across_runs": unstable,
        "times_s": times,
        "details": details,
        "summary": summary,
    }


def decode_table(cell) -> str:
    rows = []
    for name, s in cell["summary"].items():
        d = s.get("decode_tok_s")
        fmt = lambda x: f"{x:.1f}"  # noqa: E731
        rows.append(
            [
                name,
                fmt(d["min"]) if d else "",
                fmt(d["median"]) if d else "",
                fmt(d["max"]) if d else "",
                f"{s['decode_vs_hf_sdpa_loop']:.2f}x" if d else "",
                f"{s['decode_bw_fraction']['median'] * 100:.0f}%" if d else "",
                fmt(s["e2e_tok_s"]["median"]),
                f"{s['e2e_vs_hf_sdpa_generate']:.2f}x",
                f"{s['prefill_ms']['median']:.0f}" if "prefill_ms" in s else "",
            ]
        )
    return table(
        [
            "contender",
            "dec tok/s min",
            "median",
            "max",
            "vs hf_sdpa_loop",
            "of BW limit",
            "e2e tok/s",
            "e2e vs hf_sdpa_gen",
            "prefill ms",
        ],
        rows,
    )


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--threads",
        type=ints,
        default=[2, 1],
        help="comma-separated torch thread counts, one full section each (default 2,1)",
    )
    p.add_argument("--batches", type=ints, default=[1, 8], help="decode batch sizes (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved decode rounds per cell (default 3)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prefill prompt length (default 512; 0 skips)")
    p.add_argument(
        "--prefill-rounds",
        type=int,
        default=None,
        help="prefill rounds (default: as many as fit --prefill-budget, at least 5)",
    )
    p.add_argument("--prefill-budget", type=float, default=40.0, help="seconds of timed prefill rounds (default 40)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time headwise.generate(..., compile=True) (default on; its first call per batch "
        "size compiles for tens of seconds, reported apart)",
    )
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one decode step of each model at 1 thread (default on)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 16 new tokens, 1 round, prefill 128 tokens, first thread count only; "
        "saves nothing unless --out",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for decode.json / decode.txt (default benchmarks/results; not written with "
        "--quick unless given)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.rounds, args.prefill_tokens = 16, 1, 128
        args.threads, args.prefill_rounds = args.threads[:1], args.prefill_rounds or 3
    if args.out is None and not args.quick:
        args.out = Path(__file__).resolve().parent / "results"
    return args


def log_section(sec, log) -> None:
    """The tables of one thread count, printed as soon as it is done."""
    bw = sec["copy_bandwidth_gb_s"]
    log("")
    log(
        f"=== threads={sec['threads']}  (load {sec['loadavg_before'][0]:.2f} -> {sec['loadavg_after'][0]:.2f}; "
        f"copy bandwidth {bw['min']:.1f} / {bw['median']:.1f} / {bw['max']:.1f} GB/s min/median/max, "
        f"read+written, 512 MiB copy_) ==="
    )
    for cell in sec["decode"]:
        log("")
        log(
            f"Decode B={cell['B']}: {PROMPT_LEN}-token prompts + {cell['new_tokens']} new tokens, "
            f"{cell['rounds']} rounds, load {cell['loadavg_before'][0]:.2f} -> {cell['loadavg_after'][0]:.2f}"
            + (f", cpu steal {cell['steal_pct']}%" if "steal_pct" in cell else "")
            + f"; BW limit {cell['bw_limit_tok_s']:.1f} tok/s ({cell['forward_bytes_mean'] / 1e6:.1f} MB "
            f"per forward at {cell['bandwidth_gb_s']:.1f} GB/s)"
        )
        log(decode_table(cell))
        if cell["hw_ids_unstable_across_runs"]:
            log(f"  note: token ids changed between runs for {cell['hw_ids_unstable_across_runs']}")
    if sec["prefill"]:
        p = sec["prefill"]
        log("")
        log(
            f"Prefill T={p['T']} B=1 (one forward, all logits), load {p['loadavg_before'][0]:.2f} -> "
            f"{p['loadavg_after'][0]:.2f}"
        )
        log(prefill_table(p))


def verdicts(sections) -> list[dict]:
    out = []
    for sec in sections:
        for cell in sec["decode"]:
            need = 2.0 if cell["B"] == 1 else 1.5
            s = cell["summary"]["hw_generate"]
            pk = cell["summary"].get("hw_compiled")
            out.append(
                {
                    "threads": sec["threads"],
                    "what": f"decode B={cell['B']} tok/s >= {need}x hf sdpa",
                    "need": need,
                    "decode_ratio": s["decode_vs_hf_sdpa_loop"],
                    "decode_ratio_paired": s["decode_vs_hf_sdpa_loop_paired"],
                    "e2e_ratio": s["e2e_vs_hf_sdpa_generate"],
                    "compiled_decode_ratio": pk["decode_vs_hf_sdpa_loop"] if pk else None,
                    "holds": s["decode_vs_hf_sdpa_loop"] >= need,
                }
            )
        if sec.get("prefill"):
            s = sec["prefill"]["summary"]["hw"]
            pk = None
            out.append(
                {
                    "threads": sec["threads"],
                    "what": f"prefill T={sec['prefill']['T']} >= 1x hf sdpa",
                    "need": 1.0,
                    "decode_ratio": None,
                    "e2e_ratio": s["vs_hf_sdpa"],
                    "ratio_paired": s["vs_hf_sdpa_paired"],
                    "holds": s["vs_hf_sdpa"] >= 1.0,
                }
            )
    return out


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    log = Log()
    env = environment()
    env["loadavg_before"], ticks0 = loadavg(), cpu_ticks()
    model, hf, tf_version = load_models()
    env["transformers"] = tf_version
    mb = model_bytes(model)
    no_pack = packing_available()
    M = {
        "hw": model,
        "hf": hf,
        "floor": floor_weights(model),
        "hw_unpacked": unpacked_model(),
        "compile": args.compile,
        "floor_packed": None if no_pack else floor_weights(model, packed=True),
        "floor_kernel": None if kernels.kernels_unavailable() else floor_weights(model, kernel=True),
    }
    log(f"headwise decode benchmark  {env['date']}")
    log(
        f"torch {env['torch']}  transformers {tf_version}  cpu {env['cpu_model']} ({env['cpu_count']} cores)  "
        f"threads {args.threads}"
    )
    log(
        f"loadavg before {env['loadavg_before']}"
        + ("  ** busy machine (> 1.5): treat numbers with care **" if env["loadavg_before"][0] > 1.5 else "")
    )
    log(
        f"model {MODEL} fp32: {mb['params'] / 1e6:.1f} M params, {mb['weight_bytes'] / 1e6:.1f} MB of weights read "
        f"per forward (output layer {mb['output_layer_bytes'] / 1e6:.1f} MB of it); K/V "
        f"{mb['kv_bytes_per_token'] / 1e3:.1f} kB per cached token"
    )
    log(
        f"decode: B in {args.batches}, {PROMPT_LEN}-token random prompts + {args.new_tokens} new tokens, greedy, "
        f"{args.rounds} interleaved rounds after 1 warm-up; prefill: T={args.prefill_tokens}, B=1"
    )
    log(
        "hw_generate/hw_loop: the library default: the decoder block's few-rows route, its matmuls through the "
        "small-row kernel (" + (kernels.kernels_unavailable() or "available") + "), larger ones through "
        "oneDNN-prepacked weights ("
        + (no_pack or "available")
        + "); hw_general: few-rows route off ("
        + ("blocks.ROUTE_ROWS = 0" if hasattr(blocks, "ROUTE_ROWS") else "models/fast_decode.py off")
        + "); hw_no_kernel: kernel off; "
        "hw_unpacked (prefill): pack=False"
    )

    sections = []
    compile_info = []
    for i, threads in enumerate(args.threads):
        torch.set_num_threads(threads)
        log(f"threads={threads}:")
        sec = {"threads": threads, "loadavg_before": loadavg()}
        bw = copy_bandwidth()
        if args.compile and i == 0:  # compile once per batch size, outside the timed rounds
            compile_info = [try_compile(model, B, args.new_tokens, log) for B in args.batches]
            M["compile"] = all("skipped" not in c for c in compile_info)
        cells = [run_decode(B, args, M, mb, max(bw), log, check=i == 0) for B in args.batches]
        bw += copy_bandwidth()
        sec["copy_bandwidth_gb_s"] = {**summarize(bw), "samples": bw}
        for cell in cells:  # the limit uses the best copy of the whole section
            scale = cell["bandwidth_gb_s"] / max(bw)
            cell["bandwidth_gb_s"] = max(bw)
            cell["bw_limit_tok_s"] /= scale
            for s in cell["summary"].values():
                if "decode_bw_fraction" in s:
                    s["decode_bw_fraction"] = {k: v * scale for k, v in s["decode_bw_fraction"].items()}
        sec["decode"] = cells
        sec["prefill"] = run_prefill(args, M, log) if args.prefill_tokens else None
        sec["loadavg_after"] = loadavg()
        sections.append(sec)
        log_section(sec, log)
        if args.out:  # a partial file, in case the run is cut short; rewritten at the end
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "decode.json").write_text(
                json.dumps({"benchmark": "decode", "complete": False, "env": env, "sections": sections}, indent=1)
                + "\n"
            )

    profiles = []
    if args.profile:
        torch.set_num_threads(1)
        profiles = run_profiles(M, log)
    env["loadavg_after"] = loadavg()
    env.update(busy_and_steal(ticks0, cpu_ticks()))

    log("")
    log(
        "torch.compile: "
        + (
            json.dumps(compile_info)
            if compile_info is not None
            else "not run (--compile is off by default; see --help for why)"
        )
    )
    if profiles:
        log("")
        log(
            "Profiles: one decode step at B=1 after 32 tokens of context, 1 thread, torch.profiler (CPU), "
            "per step (mean of 8)"
        )
        for p in profiles:
            log("")
            log(profile_text(p))
    claims = verdicts(sections)
    log("")
    log(
        "Targets (decode: hw_generate decode rate / hf_sdpa_loop decode rate, medians; "
        "e2e: hw_generate / hf_sdpa_generate):"
    )
    for c in claims:
        if c["decode_ratio"] is not None:
            pk = c["compiled_decode_ratio"]
            log(
                f"  threads={c['threads']} {c['what']}: {c['decode_ratio']:.2f}x (paired {c['decode_ratio_paired']:.2f}x, "
                f"e2e {c['e2e_ratio']:.2f}x) -> {'HOLDS' if c['holds'] else 'MISSES'}"
                + (f"   [compile=True: {pk:.2f}x]" if pk else "")
            )
        else:
            log(
                f"  threads={c['threads']} {c['what']}: {c['e2e_ratio']:.2f}x (paired {c['ratio_paired']:.2f}x) -> "
                f"{'HOLDS' if c['holds'] else 'MISSES'}"
            )
    steal = f"  cpu busy {env['busy_pct']}% steal {env['steal_pct']}%" if "steal_pct" in env else ""
    log(f"loadavg after {env['loadavg_after']}{steal}")

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "decode",
            "complete": True,
            "env": env,
            "config": {
                "model": MODEL,
                "dtype": "float32",
                "prompt_len": PROMPT_LEN,
                "new_tokens": args.new_tokens,
                "batches": args.batches,
                "threads": args.threads,
                "rounds": args.rounds,
                "prefill_tokens": args.prefill_tokens,
                "seed": SEED,
                "tie_tol": TIE_TOL,
                "prefill_atol": PREFILL_ATOL,
                "bandwidth_copy_mib": BW_MIB,
                "order": "interleaved, rotated each round, after 1 warm-up call",
                **mb,
            },
            "sections": sections,
            "compile": compile_info,
            "profiles": profiles,
            "targets": claims,
        }
        (args.out / "decode.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "decode.txt").write_text(log.text())
        print(f"saved {args.out / 'decode.json'} and decode.txt")


if __name__ == "__main__":
    main()
