"""One claim: pruning the least important 30% of all-MiniLM-L6-v2's heads for real makes it
smaller and faster on CPU; how much quality that costs is measured, not assumed.

Plan: the heads `headwise analyze all-minilm-l6-v2` ranked least important (Michel et al.
2019), read from its analysis.json (`--plan`), or recomputed here on the fit half of the
corpus when none is given. Pruned with headwise.analysis.prune_heads (Q rows and O columns
removed: smaller matrices), saved and reloaded (the reloaded copy is what is timed).

Contenders (both with the library's default prepacked CPU linears), interleaved in rotated
rounds after warm-up (benchmarks/_common.py), once per thread count:
  full      the model as loaded
  pruned    the reloaded pruned model
Workloads: `embed` of a 32-sentence held-out batch (what analyze times) and one 128-token
sentence pair batch of 8 rows. Quality: mean cosine / nearest-neighbour agreement of the
pruned model's embeddings with the full model's on the held-out sentences.

    .venv/bin/python benchmarks/prune_heads.py --plan /tmp/analysis-minilm/analysis.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Log, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.analysis import load_pruned, param_count, prune_heads, save_pruned  # noqa: E402
from headwise.analysis.ablation import take  # noqa: E402
from headwise.analysis.capture import forward  # noqa: E402
from headwise.analysis.corpus import pydoc_corpus  # noqa: E402
from headwise.analysis.metrics import EmbeddingMetric, text_batches  # noqa: E402
from headwise.analysis.prune import clone, plan_from  # noqa: E402

MODEL = "all-minilm-l6-v2"


def plan_for(model, args) -> dict[int, list[int]]:
    if args.plan:
        res = json.loads(Path(args.plan).read_text())
        if "pruning" in res and abs(res["pruning"]["fraction"] - args.fraction) < 1e-9:
            return {int(k): v for k, v in res["pruning"]["plan"].items()}
        from headwise.analysis.importance import Importance

        imp = Importance([torch.tensor(r) for r in res["importance"]["raw"]], res["importance"]["examples"])
    else:
        from headwise.analysis import head_importance

        fit = text_batches(model, pydoc_corpus().fit_sentences[::4][:128], batch_size=32)
        imp = head_importance(model, fit)
    hpl = [12] * 6
    return plan_from(take(imp.order(), round(args.fraction * sum(hpl)), hpl), model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", help="analysis.json of `headwise analyze all-minilm-l6-v2` (its pruning plan)")
    p.add_argument("--fraction", type=float, default=0.3)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--budget", type=float, default=20.0, help="seconds per timing cell")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    log = Log()
    env = environment()
    log(f"# {env['command']}\n# {env['date']}  torch {env['torch']}  {env['cpu_model']}  loadavg {loadavg()}")
    model = headwise.load(MODEL)
    plan = plan_for(model, args)
    with tempfile.TemporaryDirectory() as d:
        pruned = load_pruned(save_pruned(prune_heads(clone(model), plan), d))
    log(f"plan ({sum(map(len, plan.values()))} heads): {plan}")
    held = text_batches(model, pydoc_corpus().heldout_sentences[::2][:192], batch_size=32)
    metric = EmbeddingMetric(model, held)
    q = metric.evaluate(pruned)
    n0, n1 = param_count(model), param_count(pruned)
    attn0 = sum(p.numel() for n, p in model.named_parameters() if ".attn." in n)
    attn1 = sum(p.numel() for n, p in pruned.named_parameters() if ".attn." in n)
    log(f"params: {n0:,} -> {n1:,} ({n1 / n0:.3f}x); attention layers {attn0:,} -> {attn1:,} ({attn1 / attn0:.3f}x)")
    log(
        f"quality on {q['sentences']} held-out sentences: mean cosine to full {q['cosine']:.4f} "
        f"(min {q['cosine_min']:.4f}), nearest-neighbour agreement {q['nn_agreement']:.3f}"
    )
    typical = held[len(held) // 2]
    long = headwise.analysis.encode(
        model, [" ".join(pydoc_corpus().heldout_paragraphs[i].split()[:90]) for i in range(8)], max_length=128
    )
    results = {"plan": plan, "params": [n0, n1], "attention_params": [attn0, attn1], "quality": q, "cells": []}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, batch in (
            (f"held-out batch {tuple(typical.ids.shape)}", typical),
            (f"long batch {tuple(long.ids.shape)}", long),
        ):
            with torch.inference_mode():
                times, rounds = time_interleaved(
                    {"full": lambda: forward(model, batch), "pruned": lambda: forward(pruned, batch)},
                    budget_s=args.budget,
                )
            s = {k: summarize(v) for k, v in times.items()}
            la = loadavg()
            log(f"\n{threads} thread(s), {name}, {rounds} rounds, loadavg {la}")
            log(
                table(
                    ["contender", "min ms", "median ms", "max ms", "vs full (median)"],
                    [
                        [
                            k,
                            f"{v['min'] * 1e3:.1f}",
                            f"{v['median'] * 1e3:.1f}",
                            f"{v['max'] * 1e3:.1f}",
                            f"{s['full']['median'] / v['median']:.2f}x",
                        ]
                        for k, v in s.items()
                    ],
                )
            )
            results["cells"].append(
                {"threads": threads, "workload": name, "rounds": rounds, "loadavg": la, "summary": s}
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prune_heads.json").write_text(json.dumps(results | {"env": env}, indent=1))
    (out / "prune_heads.txt").write_text(log.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
