"""Concurrent sequences in one fixed KV pool: full vs pruned SmolLM2 (issue 16).

SmolLM2 has 3 KV heads x 3 query heads per layer. Head importance (analysis.head_importance,
gradient of the loss w.r.t. head gates, on the pydoc corpus's fit sentences) scores each KV
group (the sum over its 3 query heads). Two plans remove whole groups for real: the 15 least
important groups, at most one per layer ("uneven": layers differ), and each layer's least
important group ("every layer": Hkv 3 -> 2). Quality: perplexity on held-out sentences. Each variant is saved with save_pruned and loaded as
`headwise serve` loads it (load_pruned(uniform_kv=True)), then an Engine gets the same
memory_budget_bytes and many distinct prompts (no prefix sharing), each 120 prompt tokens +
8 generated = 128 tokens = 8 blocks of 16, held from admission on. We step the engine until
the first request finishes and report the most sequences it ran at once (engine stats).

The paged pool holds one KV-head count for every layer (model.config.num_kv_heads, the
largest left), so only the "every layer" plan shrinks it. The column "if per-layer" is what
a pool sized by each layer's own KV heads would hold (not built: cache/ change).

    .venv/bin/python benchmarks/pruned_capacity.py [--budget-mib 96] [--out benchmarks/results/pruned_capacity.txt]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import headwise  # before torch: its OpenMP settings
import torch

from _common import cpu_model  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from headwise.analysis import encode, head_importance, metrics, prune_heads, save_pruned
from headwise.analysis.corpus import pydoc_corpus
from headwise.analysis.prune import clone, kv_bytes_per_token, load_pruned, param_count
from headwise.engine import Engine, EngineConfig
from headwise.generation import SamplingParams

PROMPT, NEW, BS = 120, 8, 16


def run(model, budget: int, n_requests: int) -> dict:
    cfg = EngineConfig(memory_budget_bytes=budget, block_size=BS, max_num_seqs=256, max_num_batched_tokens=1024)
    engine = Engine(model, config=cfg)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    for i in range(n_requests):  # distinct random prompts: no block is shared by prefix
        ids = torch.randint(100, V, (PROMPT,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=NEW, temperature=0), request_id=f"r{i}")
    peak, running, steps, t0 = 0, 0, 0, time.perf_counter()
    while True:
        done = engine.step()
        steps += 1
        s = engine.stats()
        if done:  # the first request finished: until the step before, nothing had left the pool
            break
        running, peak = s.running, max(peak, s.running)
    pool = engine.cache
    out = {
        "pool_blocks": pool.num_blocks,
        "pool_bytes": pool.memory_bytes(),
        "bytes_per_token": pool.memory_bytes() // (pool.num_blocks * pool.block_size),
        "peak_running": peak,  # at most one over `running`: a prompt admitted and then preempted
        "running": running,  # the step before the first finished
        "fit": pool.num_blocks // ((PROMPT + NEW) // BS),
        "preemptions": s.preemptions,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }
    engine.shutdown(timeout=5)
    return out


def perplexity(model, held) -> float:
    return metrics.LMMetric(held).evaluate(model)["perplexity"]


def group_plans(full, fit) -> dict[str, dict[int, list[int]]]:
    imp = head_importance(full, fit).normalized  # per layer (H,)
    G = full.config.num_heads // full.config.num_kv_heads
    score = [(float(t[g * G : (g + 1) * G].sum()), l, g) for l, t in enumerate(imp) for g in range(len(t) // G)]
    least = {}  # layer -> its least important group
    for s, l, g in sorted(score):
        least.setdefault(l, (s, g))
    heads = {l: list(range(g * G, (g + 1) * G)) for l, (_, g) in least.items()}
    half = sorted(least, key=lambda l: least[l][0])[: len(least) // 2]
    return {
        f"uneven ({len(half)} layers lose a group)": {l: heads[l] for l in sorted(half)},
        f"every layer ({len(heads)} groups)": heads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=96)
    ap.add_argument("--out", default="benchmarks/results/pruned_capacity.txt")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    budget = int(args.budget_mib * 2**20)
    full = headwise.load("smollm2", weights="fp32")  # save_pruned writes float weights
    corpus = pydoc_corpus()
    fit = [encode(full, corpus.fit_sentences[i : i + 8], max_length=64) for i in range(0, 32, 8)]
    held = [encode(full, corpus.heldout_sentences[i : i + 8], max_length=64) for i in range(0, 32, 8)]
    plans = group_plans(full, fit)
    lines = [
        f"SmolLM2-135M fp32, KV pool memory_budget_bytes = {args.budget_mib:g} MiB, block_size {BS}, "
        f"requests of {PROMPT} + {NEW} tokens ({(PROMPT + NEW) // BS} blocks each), distinct prompts",
        f"cpu {cpu_model()}, load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}",
        "",
        f"{'variant':40s} {'params':>11s} {'pool B/tok':>10s} {'blocks':>6s} {'seqs':>9s} {'ratio':>6s} "
        f"{'if per-layer':>12s} {'ppl':>6s} {'preempt':>7s}",
    ]
    base = None
    rows = [("full", full, None)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans.items():
            small = prune_heads(clone(full), plan)
            path = save_pruned(small, os.path.join(tmp, str(len(rows))))
            rows.append((name, load_pruned(path, uniform_kv=True), kv_bytes_per_token(small)))
            del small
        for name, model, per_layer in rows:
            r = run(model, budget, n_requests=48)
            base = base or r
            ppl = perplexity(model, held)
            per = per_layer or kv_bytes_per_token(model)
            per_layer_seqs = budget // (per * BS) // ((PROMPT + NEW) // BS)
            params = model.pruned["parameters"] if hasattr(model, "pruned") else param_count(model)
            lines.append(
                f"{name:40s} {params:>11,d} {r['bytes_per_token']:>10,d} {r['pool_blocks']:>6d} "
                f"{r['running']:>9d} {r['running'] / base['running']:>5.2f}x {per_layer_seqs:>12d} "
                f"{ppl:>6.2f} {r['preemptions']:>7d}"
            )
            print(lines[-1], f"(peak {r['peak_running']}, {r['steps']} steps, {r['seconds']:.1f} s)", file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
