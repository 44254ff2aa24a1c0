"""Head-parallel decoding (headwise.parallel) on this machine: tok/s and the all-reduce's share.

    .venv/bin/python benchmarks/parallel.py                # SmolLM2 fp32, N = 1 and 3, gloo
    .venv/bin/python benchmarks/parallel.py --weights auto  # the GGUF's quantized blocks

Each contender is a group of processes from headwise.parallel.spawn (one torch thread per
rank unless said): N=1 is the whole model in one process (no collectives), N=3 splits
SmolLM2's 3 KV heads over 3 ranks with the output head replicated or split over the
vocabulary. Every rank decodes B=1 greedily, step by step over a contiguous cache (what
generate() does), and counts the time its collectives take (Comm.seconds: this includes
waiting for the slowest rank, so on an oversubscribed machine it is the cost of the
imbalance as well as of the wire). A separate loop times one all-reduce of a (1, C) row,
the payload of each of the 2 per layer a decode step makes. No GPU here: NCCL is not measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import Log, cpu_model, environment, loadavg, table  # noqa: F401 - sets sys.path, imports headwise

import torch

from headwise.parallel import shard, spawn

RESULTS = Path(__file__).parent / "results"


def rank_run(comm, weights: str, lm_head: str, steps: int, rounds: int) -> dict:
    """On every rank: load, shard (N > 1), decode `steps` tokens `rounds` times; rank 0's figures."""
    from headwise.models import load
    from headwise.cache import ContiguousKVCache

    model = load("smollm2-135m-instruct", weights=weights)
    if comm.world_size > 1:
        shard(model, comm, lm_head=lm_head)
    cfg = model.config
    prompt = torch.tensor([model.tokenizer.encode("The history of the printing press begins")])
    out = {"decode_s": [], "comm_s": [], "calls": 0, "bytes": 0, "ids": None}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up (packing, kernel plans)
            cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, prompt.shape[1] + steps, cfg.head_dim)
            nxt = model(prompt, cache.step(prompt.shape[1]))[:, -1].argmax(-1)
            ids = [int(nxt)]
            comm.reset_stats()
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                nxt = model(nxt[:, None], cache.step(1))[:, -1].argmax(-1)
                ids.append(int(nxt))
            if r:
                out["decode_s"].append(time.perf_counter() - t0)
                out["comm_s"].append(comm.seconds)
                out["calls"], out["bytes"] = comm.calls, comm.bytes
            out["ids"] = ids
        if comm.world_size > 1:  # one all-reduce of a decode step's payload, alone
            x = torch.zeros(1, cfg.d_model)
            for _ in range(50):
                comm.all_reduce(x, "warm-up")
            comm.reset_stats()
            for _ in range(500):
                comm.all_reduce(x, "timing")
            out["allreduce_us"] = comm.seconds / 500 * 1e6
    return out


def allreduce_only(comm, width: int, calls: int) -> float:
    """Microseconds per all-reduce of a (1, width) fp32 row, with no model loaded on any rank."""
    x = torch.zeros(1, width)
    for _ in range(50):
        comm.all_reduce(x, "warm-up")
    comm.reset_stats()
    for _ in range(calls):
        comm.all_reduce(x, "timing")
    return comm.seconds / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="fp32", help="fp32 (default) or auto (the GGUF's quantized blocks)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="results file stem (default parallel / parallel_<weights>)")
    args = ap.parse_args()
    log = Log()
    env = environment()
    log(
        f"parallel benchmark: SmolLM2-135M {args.weights}, B=1 greedy decode, {args.steps} steps x "
        f"{args.rounds} rounds after 1 warm-up; gloo on CPU; {env['date']}, torch {env['torch']}, "
        f"{env['cpu_model']}, {env['cpu_count']} cores; loadavg {loadavg()}"
    )
    log("no GPU was available: NCCL not measured")
    contenders = [  # (name, N, threads per rank, lm_head)
        ("N=1 1 thread", 1, 1, "replicated"),
        ("N=1 2 threads", 1, 2, "replicated"),
        ("N=3 replicated head", 3, 1, "replicated"),
        ("N=3 vocab-split head", 3, 1, "vocab"),
    ]
    rows, results = [], {}
    reference = None
    for name, N, threads, head in contenders:
        t0 = time.perf_counter()
        r = spawn(rank_run, N, args.weights, head, args.steps, args.rounds, threads=threads, deadline_s=600)[0]
        wall = time.perf_counter() - t0
        med = sorted(r["decode_s"])[len(r["decode_s"]) // 2]
        comm = sorted(r["comm_s"])[len(r["comm_s"]) // 2]
        per_step = args.steps - 1
        same = "ref" if reference is None else ("same" if r["ids"] == reference else "DIFFERENT")
        reference = reference or r["ids"]
        results[name] = dict(r, N=N, threads=threads, lm_head=head, wall_s=wall)
        log(
            f"  {name}: {per_step / med:.1f} tok/s, comm {comm / per_step * 1e3:.2f} ms/token "
            f"({r['calls'] // per_step} calls), greedy ids {same}; group wall {wall:.1f} s; load {loadavg()}"
        )
        rows.append(
            [
                name,
                N * threads,
                f"{per_step / med:.1f}",
                f"{med / per_step * 1e3:.1f}",
                f"{comm / per_step * 1e3:.2f}" if N > 1 else "-",
                f"{100 * comm / med:.0f}%" if N > 1 else "-",
                r["calls"] // per_step if N > 1 else "-",
                f"{r['bytes'] / max(r['calls'], 1) / 1024:.1f}" if N > 1 else "-",
                f"{r['allreduce_us']:.0f}" if N > 1 else "-",
                same,
            ]
        )
    floors = {N: spawn(allreduce_only, N, 576, 2000)[0] for N in (2, 3)}
    log(
        f"  all-reduce alone, (1, 576) fp32, no model loaded: N=2 {floors[2]:.0f} us, N=3 {floors[3]:.0f} us "
        f"per call (x 60 calls a SmolLM2 decode step: {floors[2] * 60e-3:.1f} / {floors[3] * 60e-3:.1f} ms); "
        f"load {loadavg()}"
    )
    results["allreduce_only_us"] = floors
    log("")
    log(
        table(
            [
                "contender",
                "threads",
                "tok/s",
                "ms/token",
                "comm ms/token",
                "comm share",
                "calls/token",
                "KiB/call",
                "1 all-reduce us",
                "greedy ids",
            ],
            rows,
        )
    )
    log(
        "comm: rank 0's time inside collectives per decode step (2 all-reduces a layer, plus the head's "
        "all-gather when vocab-split), including waits for slower ranks; 1 all-reduce: a (1, C) fp32 row alone"
    )
    stem = args.out or ("parallel" if args.weights == "fp32" else f"parallel_{args.weights}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.txt").write_text(log.text())
    (RESULTS / f"{stem}.json").write_text(json.dumps({"env": env, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
