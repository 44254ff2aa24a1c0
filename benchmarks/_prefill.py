"""decode.py's prefill cell: one T-token forward returning all logits, headwise vs transformers
(and the plain-linear model and the matmul floors), logits checked against headwise's first."""

from __future__ import annotations

import statistics
import sys

from _common import busy_and_steal, cpu_ticks, loadavg, summarize, table, time_interleaved
import torch
from _contenders import SEED, floor_forward, make_prompts

PREFILL_ATOL = 1e-3  # max |logits difference| headwise vs HF at prefill


def run_prefill(args, M: dict, log) -> dict:
    model = M["hw"]
    T = args.prefill_tokens
    ids = make_prompts(1, model.config.vocab_size, T=T, seed=SEED + 99)
    fns = {"hw": lambda: model(ids)}
    if M.get("hw_unpacked") is not None:
        fns["hw_unpacked"] = lambda: M["hw_unpacked"](ids)
    for impl, m in M["hf"].items():
        fns[f"hf_{impl}"] = lambda m=m: m(input_ids=ids, use_cache=False).logits
    x = torch.randn(1, T, model.config.d_model)
    for name in ("floor", "floor_packed"):
        if M.get(name) is not None:
            fns[name] = lambda w=M[name]: floor_forward(w, x)
    with torch.inference_mode():
        ref = fns["hw"]()
        diffs = {n: (fn() - ref).abs().max().item() for n, fn in fns.items() if n != "hw" and not n.startswith("floor")}
        del ref
        bad = {n: d for n, d in diffs.items() if d > PREFILL_ATOL}
        if bad:
            sys.exit(f"prefill logits differ from headwise by {bad} > {PREFILL_ATOL}; refusing to time")
        load0, ticks0 = loadavg(), cpu_ticks()
        times, rounds = time_interleaved(
            fns, rounds=args.prefill_rounds, budget_s=args.prefill_budget, min_rounds=5, warmup=1
        )
    load1, cpu = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    summary = {}
    for name, ts in times.items():
        s = {"ms": summarize([t * 1e3 for t in ts]), "tok_s": summarize([T / t for t in ts])}
        summary[name] = s
    for name, s in summary.items():
        s["vs_hf_sdpa"] = summary["hf_sdpa"]["ms"]["median"] / s["ms"]["median"]
        s["vs_hf_sdpa_paired"] = statistics.median(b / a for a, b in zip(times[name], times["hf_sdpa"]))
    log(
        f"  done prefill T={T} rounds={rounds} load {load0[0]:.2f} -> {load1[0]:.2f}"
        + (f"  cpu busy {cpu['busy_pct']}% steal {cpu['steal_pct']}%" if cpu else "")
    )
    return {
        "T": T,
        "B": 1,
        "rounds": rounds,
        "loadavg_before": load0,
        "loadavg_after": load1,
        **cpu,
        "max_abs_logit_diff_vs_hw": diffs,
        "times_s": times,
        "summary": summary,
    }


def prefill_table(cell) -> str:
    rows = [
        [
            name,
            cell["rounds"],
            f"{s['ms']['min']:.0f}",
            f"{s['ms']['median']:.0f}",
            f"{s['ms']['max']:.0f}",
            f"{s['tok_s']['median']:.0f}",
            f"{s['vs_hf_sdpa']:.2f}x",
            f"{cell['max_abs_logit_diff_vs_hw'][name]:.1e}"
            if name in cell["max_abs_logit_diff_vs_hw"]
            else ("(bound)" if name.startswith("floor") else "(ref)"),
        ]
        for name, s in cell["summary"].items()
    ]
    return table(["contender", "n", "min ms", "median ms", "max ms", "tok/s", "vs hf_sdpa", "|logits diff|"], rows)
