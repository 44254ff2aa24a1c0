"""Two claims: the continuous-batching engine serves many prompts at several times the output-token
throughput of running them one at a time (issue 5: 16 prompts >= 6x headwise, >= 8x transformers),
and one request alone through the engine decodes at >= 0.9x headwise.generate's batch-1 rate (issue 13).

Model: SmolLM2-135M-Instruct fp32: headwise.load (the builtin GGUF, dequantized) and transformers'
LlamaForCausalLM holding the very same tensors (built by benchmarks/_contenders.py's load_models, sdpa
attention). CPU, inference only, greedy, EOS ignored so every request makes exactly --new-tokens.

Prompts: random token ids, 112 to 144 tokens each (~128), the same for every contender.
Contenders, output tokens per second, end to end (prefill included, wall clock):
  engine_<N>   Engine(model, max_num_seqs=64, max_num_batched_tokens=512).generate(N prompts): all
               N scheduled together; the prefix cache is cleared before each run (no reuse across rounds);
               engine_1 is one request alone
  hw_one       headwise.generate(model, prompt) for each prompt in turn
  hf_one       hf.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new) for each in turn
A one-at-a-time contender's throughput does not depend on how many prompts there are (each runs
alone, and they all have ~128 tokens), so it runs on the first --subset prompts (default 4) to keep
the run short; the output says so. Rounds run every contender once, in an order rotated each round
(benchmarks/_common.py); min / median / max per contender, ratios of medians.
Decode rate (engine_1 vs generate, like with like): tokens after the first over the time they
took: for the engine (tokens - 1) / the sum of the request's inter-token gaps (Engine.stats().itl_s),
for generate() GenerationResult.tokens_per_second (over hw_one's prompts: their tokens after the
first / their decode_seconds summed). For engine_<N> with N > 1 the same number is per request
(1 / mean inter-token gap), shown for reference.

Agreement (before timing): the engine's greedy ids for the subset prompts must equal hw_one's
(the engine batches, chunks and packs the same fp32 arithmetic differently, so a near-tie could in
principle flip a token: a divergence is reported with the top-2 logit margin, not hidden).

Profile: one decode step of 16 running sequences (after their prefill), engine phases from
`Engine.stats().step_seconds`, and torch.profiler's op categories (benchmarks/_profile.py's profile_step).

    .venv/bin/python benchmarks/engine.py                 # ~10 min; saves results/engine.{txt,json}
    .venv/bin/python benchmarks/engine.py --quick         # smoke test: 8 new tokens, 1 round, no save
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise import Engine, SamplingParams  # noqa: E402

SEED = 2024


def make_prompts(n: int, V: int, seed: int = SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(112, 145, (n,), generator=g).tolist()
    return [torch.randint(17, V, (T,), generator=g).tolist() for T in lens]  # ids < 17 are special


def run_engine(engine: Engine, prompts, params) -> dict:
    engine.cache.pool.clear_prefix_cache()  # every round computes every prompt
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = engine.stats()
    n = len(prompts)
    gaps = after.itl_s[-sum(len(o.token_ids) - 1 for o in outs) :]  # this run's inter-token gaps (most recent)
    return {
        "wall_s": wall,
        "decode_tok_s": len(gaps) / sum(gaps) if gaps else None,
        "tokens": sum(len(o.token_ids) for o in outs),
        "ids": [o.token_ids for o in outs],
        "prefix_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "preemptions": after.preemptions - before.preemptions,
        "steps": after.steps - before.steps,
        "ttft_ms_median": 1e3 * statistics.median(after.ttft_s[-n:]),
        "itl_ms_median": 1e3 * statistics.median(after.itl_s[-n * (params.max_new_tokens - 1) :] or [0.0]),
        "step_seconds": {k: after.step_seconds[k] - before.step_seconds[k] for k in after.step_seconds},
    }


def run_hw_one(model, prompts, params, kv_dtype=None) -> dict:
    t0 = time.perf_counter()
    res = [headwise.generate(model, p, params, kv_dtype=kv_dtype) for p in prompts]
    wall = time.perf_counter() - t0
    ids = [r.token_ids for r in res]
    # tokens_per_second of all prompts together: their tokens after the first / their decode time
    decode = sum(len(r.token_ids) - 1 for r in res) / sum(r.decode_seconds for r in res)
    return {"wall_s": wall, "tokens": sum(map(len, ids)), "ids": ids, "decode_tok_s": decode}


def run_hf_one(hf, prompts, new: int) -> dict:
    ids = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
            ids.append(out[0, len(p) :].tolist())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(map(len, ids)), "ids": ids}


def agreement(model, prompts, engine_ids, ref_ids, name) -> dict:
    """Count identical greedy outputs; explain each divergence by the top-2 logit margin of
    headwise's model there and by whether the engine's token is a stop id (hf.generate's
    min_new_tokens forbids EOS, the engine with ignore_eos emits it and goes on)."""
    same, notes = 0, []
    stops = model.tokenizer.stop_token_ids
    for p, a, b in zip(prompts, engine_ids, ref_ids):
        if a == b:
            same += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.inference_mode():
            logits = model(torch.tensor([p + b[:i]]))[0, -1]
        top = logits.topk(2).values
        notes.append(
            {
                "first_divergence": i,
                "engine_token": a[i],
                "ref_token": b[i],
                "engine_token_is_stop_id": a[i] in stops,
                "top2_margin": float(top[0] - top[1]),
            }
        )
    return {"vs": name, "identical": same, "of": len(prompts), "divergences": notes}


def profile_decode(model, log) -> dict:
    """One decode step of 16 running sequences: wall, engine phases, op categories."""
    from _profile import profile_step, profile_text

    params = SamplingParams(max_new_tokens=4096, temperature=0, ignore_eos=True)
    prompts = make_prompts(16, model.config.vocab_size, seed=SEED + 1)

    def setup():
        engine = Engine(model, max_num_seqs=64)
        for p in prompts:
            engine.add_request(p, params)
        while engine.stats().waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # until every prompt is prefilled
        return engine

    def step(engine):
        engine.step()

    engine = setup()
    for _ in range(3):
        step(engine)
    before = engine.stats().step_seconds
    steps = 20
    for _ in range(steps):
        step(engine)
    phases = {k: 1e3 * (v - before[k]) / steps for k, v in engine.stats().step_seconds.items()}
    p = profile_step("engine, 16 decodes", setup, step)
    p["phases_ms"] = phases
    log(profile_text(p))
    log("engine phases per step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,64", help="engine batch sizes (default 1,16,64)")
    ap.add_argument(
        "--weights",
        default="fp32",
        help="headwise.load's weights= (default fp32, the GGUF dequantized, as transformers runs it; "
        "'auto': the GGUF's blocks as stored, needs --no-hf)",
    )
    ap.add_argument("--subset", type=int, default=4, help="prompts run one at a time per round (default 4)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument(
        "--kv-dtype", default=None, choices=["int8"], help="K/V caches of the engines and of hw_one (default: fp32)"
    )
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8 new tokens, 1 round, sizes 1,16, nothing saved")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.weights != "fp32" and not args.no_hf:
        ap.error(f"--weights {args.weights}: transformers runs fp32 only; add --no-hf")
    if args.quick:
        args.new_tokens, args.rounds, args.sizes = 8, 1, "1,16"
    out_dir = args.out or (None if args.quick else Path(__file__).resolve().parent / "results")
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    log = Log()
    env = environment()
    log(
        f"engine benchmark: SmolLM2-135M weights={args.weights}, kv_dtype={args.kv_dtype}, {args.threads} threads, "
        f"{args.new_tokens} new tokens per prompt, "
        f"prompts of 112-144 tokens; {env['date']}, torch {env['torch']}, {env['cpu_model']}"
    )

    if args.no_hf:
        model, hf = headwise.load("smollm2-135m-instruct", weights=args.weights), None
    else:
        from _contenders import load_models

        model, hfs, tf_version = load_models()
        hf = hfs["sdpa"]
        for other in [k for k in hfs if k != "sdpa"]:
            del hfs[other]
    V = model.config.vocab_size
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    prompts = make_prompts(max(sizes), V)
    subset = prompts[: args.subset]
    engines = {n: Engine(model, max_num_seqs=64, max_num_batched_tokens=512, kv_dtype=args.kv_dtype) for n in sizes}

    # warm-up (first forwards pack weights, allocate scratch) and agreement
    warm = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for e in engines.values():
        e.generate(prompts[:2], warm)
    run_hw_one(model, prompts[:1], warm, args.kv_dtype)
    if hf is not None:
        run_hf_one(hf, prompts[:1], 4)
    fns = {f"engine_{n}": (lambda n=n: run_engine(engines[n], prompts[:n], params)) for n in sizes}
    fns["hw_one"] = lambda: run_hw_one(model, subset, params, args.kv_dtype)
    if hf is not None:
        fns["hf_one"] = lambda: run_hf_one(hf, subset, args.new_tokens)

    load0, ticks0 = loadavg(), cpu_ticks()
    details: dict[str, list[dict]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for name in rotated(list(fns), r):
            details[name].append(fns[name]())
            d = details[name][-1]
            log(
                f"  round {r + 1} {name}: {d['tokens']} tokens in {d['wall_s']:.1f} s = "
                f"{d['tokens'] / d['wall_s']:.1f} tok/s (load {loadavg()[0]:.2f})"
            )
    load1, cpu = loadavg(), busy_and_steal(ticks0, cpu_ticks())

    agree = []  # every engine size vs the one-at-a-time runs, on the prompts they share
    for n in sizes:
        k = min(n, len(subset))
        got = details[f"engine_{n}"][0]["ids"][:k]
        for ref in ("hw_one", "hf_one") if hf is not None else ("hw_one",):
            agree.append({"engine": f"engine_{n}", **agreement(model, subset[:k], got, details[ref][0]["ids"], ref)})

    summary = {k: summarize([d["tokens"] / d["wall_s"] for d in v]) for k, v in details.items()}
    decode = {
        k: summarize([d["decode_tok_s"] for d in v])
        for k, v in details.items()
        if all(d.get("decode_tok_s") for d in v)
    }

    def rate(d: dict, key: str) -> float:
        return d["tokens"] / d["wall_s"] if key == "output" else d["decode_tok_s"]

    def paired(a: str, b: str, key: str = "output") -> float:
        """Median over rounds of a's rate / b's rate in the same round (drift hits both)."""
        return statistics.median(rate(x, key) / rate(y, key) for x, y in zip(details[a], details[b]))

    rows = []
    for name, s in summary.items():
        prompts_n = int(name.split("_")[1]) if name.startswith("engine_") else len(subset)
        extra = ""
        if name.startswith("engine_"):
            d = details[name]
            extra = (
                f"ttft {statistics.median([x['ttft_ms_median'] for x in d]):.0f} ms, itl "
                f"{statistics.median([x['itl_ms_median'] for x in d]):.0f} ms, {d[0]['steps']} steps, "
                f"{d[0]['preemptions']} preemptions"
            )
        dec = f"{decode[name]['median']:.1f}" if name in decode else ""
        rows.append(
            [
                name,
                prompts_n,
                f"{s['min']:.1f}",
                f"{s['median']:.1f}",
                f"{s['max']:.1f}",
                dec,
                f"{s['median'] / summary['hw_one']['median']:.2f}x ({paired(name, 'hw_one'):.2f}x)",
                f"{s['median'] / summary['hf_one']['median']:.2f}x ({paired(name, 'hf_one'):.2f}x)"
                if hf is not None
                else "",
                extra,
            ]
        )
    log("")
    log(
        f"Output tokens/s, {args.rounds} rounds, load {load0[0]:.2f} -> {load1[0]:.2f}"
        + (f", cpu busy {cpu['busy_pct']}% steal {cpu['steal_pct']}%" if cpu else "")
        + f"; one-at-a-time contenders measured on the first {len(subset)} prompts (per-token rate):"
    )
    log(
        table(
            [
                "contender",
                "prompts",
                "tok/s min",
                "median",
                "max",
                "decode tok/s/req",
                "vs hw_one (paired)",
                "vs hf_one (paired)",
                "engine notes",
            ],
            rows,
        )
    )
    log(
        "ratios: of medians; in brackets, the median over rounds of the same round's ratio; decode tok/s/req: "
        "a request's tokens after its first / the time they took (engine: its inter-token gaps; hw_one: "
        "generate()'s tokens_per_second)"
    )
    for a in agree:
        log(
            f"greedy ids, {a['engine']} vs {a['vs']}: {a['identical']}/{a['of']} identical"
            + (f"; divergences {a['divergences']}" if a["divergences"] else "")
        )
    for n in sizes:
        ph = details[f"engine_{n}"][0]["step_seconds"]
        log(f"engine_{n} time by phase (first round): " + ", ".join(f"{k} {v:.2f} s" for k, v in ph.items()))
    verdicts = []

    def target(claim: str, a: str, b: str, key: str, need: float) -> None:
        r = (summary if key == "output" else decode)[a]["median"] / (summary if key == "output" else decode)[b][
            "median"
        ]
        verdicts.append(
            {"claim": claim, "ratio": r, "paired": paired(a, b, key), "target": f">= {need}x", "met": r >= need}
        )

    if 1 in sizes and "engine_1" in decode:
        target(
            "engine_1 (one request alone) decode tok/s / generate() B=1 tokens_per_second (hw_one)",
            "engine_1",
            "hw_one",
            "decode",
            0.9,
        )
    if 16 in sizes:
        target("engine_16 output tok/s / one-at-a-time generate() (hw_one)", "engine_16", "hw_one", "output", 6)
        if hf is not None:
            target("engine_16 output tok/s / one-at-a-time hf.generate (hf_one)", "engine_16", "hf_one", "output", 8)
    log("targets (ratios of medians; paired in brackets):")
    for v in verdicts:
        log(
            f"  {'MET    ' if v['met'] else 'NOT MET'} {v['claim']}: {v['ratio']:.2f}x (paired {v['paired']:.2f}x; "
            f"target {v['target']})"
        )

    prof = None
    if not args.no_profile:
        log("")
        prof = profile_decode(model, log)

    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for d in details.values():
            for x in d:
                x.pop("ids", None)
        result = {
            "environment": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "loadavg_before": load0,
            "loadavg_after": load1,
            **cpu,
            "summary": summary,
            "decode_summary": decode,
            "details": details,
            "agreement": agree,
            "verdicts": verdicts,
            "profile": prof,
            "transformers": None if hf is None else tf_version,
        }
        (out_dir / "engine.json").write_text(json.dumps(result, indent=1))
        (out_dir / "engine.txt").write_text(log.text())
        log(f"saved {out_dir / 'engine.json'} and engine.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
