"""One claim: a preallocated cache makes decoding O(N) in cache traffic, where the
seed's `torch.cat` update is O(N^2).

One attention layer, B=1, decoding N tokens from an empty cache: every step
appends one token's K/V and attends one query over everything cached. fp32,
torch.inference_mode. Shapes: MHA H=Hkv=12, D=64 (GPT-2 small) and GQA H=32,
Hkv=8, D=128 (Llama-2-70B-style heads). N in {512, 2048, 8192}. Contenders:

  seed        the seed's `update_kv_cache` verbatim (`torch.cat` along dim 2), then
              `F.scaled_dot_product_attention(q, k_cache, v_cache)` (no mask: T=1;
              GQA through enable_gqa=True, PyTorch's fastest grouped path, so the
              comparison isolates the cache update)
  contiguous  ContiguousKVCache: `read = layer.update(k, v)`; `read.attend(q, is_causal=True)`
  int8        the same with kv_dtype="int8" (each read dequantizes the cached slice)
  paged       PagedKVCache, block_size=16, if `headwise.cache` has it

For each: total time of the N-step decode (cache built inside the timing), the
per-step time over the last 64 steps (the cost at length ~N), the cache-update
time alone (N appends, no attention; timed separately), and K/V bytes per token.
Every contender's last output is checked against the seed's before its time
counts (fp32 within 1e-4, int8 within 2e-2 of the output's max).

Timing: one 256-step warm-up run of every contender, then rounds (10 at N=512, 9 at
2048, 3 at 8192; `--rounds` overrides) in which each contender runs once, order
rotated every round (benchmarks/_common.py);
min / median / max reported, ratios are of medians. Load average and CPU steal
are recorded per cell.

    .venv/bin/python benchmarks/kv_cache.py            # full run (~45 min on a busy 2-core box); saves results/
    .venv/bin/python benchmarks/kv_cache.py --quick    # N=512, 2 rounds; nothing saved
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import (
    Log,
    busy_and_steal,
    cpu_ticks,
    environment,
    loadavg,
    rotated,  # noqa: E402
    summarize,
    table,
)
import torch  # noqa: E402  (after _common: headwise first)
import torch.nn.functional as F  # noqa: E402
import headwise.cache as hwcache  # noqa: E402
from headwise.cache import ContiguousKVCache  # noqa: E402

CONFIGS = {"mha": dict(H=12, Hkv=12, D=64), "gqa": dict(H=32, Hkv=8, D=128)}
TAIL = 64  # steps at the end whose mean is "per-step time at length ~N"
WARMUP_STEPS = 256
BLOCK = 16
FP32_TOL, INT8_REL_TOL = 1e-4, 2e-2
CLAIM_N, CLAIM_TOTAL, CLAIM_UPDATE, CLAIM_BYTES = 8192, 1.8, 50.0, 0.3


# ------------------------------------------------------------------ the seed, verbatim
def update_kv_cache(kv_cache, new_k, new_v, layer_idx):
    # kv_cache: list of (k_cache, v_cache) per layer
    # new_k, new_v: (batch, num_kv_heads, 1, d_k)
    k_cache, v_cache = kv_cache[layer_idx]
    k_cache = torch.cat([k_cache, new_k], dim=2)
    v_cache = torch.cat([v_cache, new_v], dim=2)
    kv_cache[layer_idx] = (k_cache, v_cache)
    return kv_cache


# ------------------------------------------------------------------ contenders
def inputs(cfg, N, seed=0):
    """Per-step tensors: q[t] (1, H, 1, D), k[t], v[t] (1, Hkv, 1, D), each contiguous."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
    return (
        torch.randn(N, 1, H, 1, D, generator=g),
        torch.randn(N, 1, Hkv, 1, D, generator=g),
        torch.randn(N, 1, Hkv, 1, D, generator=g),
    )


def paged_available() -> str | None:
    """None if PagedKVCache can be used, else why not."""
    if not hasattr(hwcache, "PagedKVCache"):
        return "not available (headwise.cache has no PagedKVCache yet)"
    return None


class Contender:
    """decode(q, k, v, N) -> (last output, seconds per step over the last TAIL steps);
    updates(k, v, N) -> None; bytes_per_token(cfg) -> int."""

    def __init__(self, name, cfg):
        self.name, self.cfg = name, cfg
        self.gqa = cfg["H"] != cfg["Hkv"]

    # -- per contender: a fresh cache for N tokens and how one step appends
    def new_cache(self, N):
        Hkv, D = self.cfg["Hkv"], self.cfg["D"]
        if self.name == "seed":
            return [(torch.empty(1, Hkv, 0, D), torch.empty(1, Hkv, 0, D))]
        if self.name in ("contiguous", "int8"):
            return ContiguousKVCache(1, 1, Hkv, N, D, kv_dtype="int8" if self.name == "int8" else None).layer(0)
        cache = hwcache.PagedKVCache(
            num_layers=1,
            num_kv_heads=Hkv,
            head_dim=D,
            num_blocks=math.ceil(N / BLOCK),
            block_size=BLOCK,
            dtype=torch.float32,
        )
        cache.add_sequence(0)
        return cache

    def append(self, cache, k, v):
        """Append one token; return what attention reads (the seed: the new cache list)."""
        if self.name == "seed":
            return update_kv_cache(cache, k, v, 0)
        if self.name in ("contiguous", "int8"):
            return cache.update(k, v)
        return cache.batch([0], num_new=1).layer(0).update(k, v)

    def attend(self, read, q):
        if self.name == "seed":
            k_cache, v_cache = read[0]
            return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=self.gqa)
        return read.attend(q, is_causal=True)

    def decode(self, Q, K, V, N):
        cache = self.new_cache(N)
        tail_from = max(N - TAIL, 0)
        for t in range(N):
            if t == tail_from:
                t0 = time.perf_counter()
            out = self.attend(self.append(cache, K[t], V[t]), Q[t])
        return out, (time.perf_counter() - t0) / (N - tail_from)

    def updates(self, K, V, N):
        cache = self.new_cache(N)
        for t in range(N):
            self.append(cache, K[t], V[t])

    def bytes_per_token(self, N):
        Hkv, D = self.cfg["Hkv"], self.cfg["D"]
        if self.name == "seed":
            return 2 * Hkv * D * 4
        cache = self.new_cache(N)
        if self.name in ("contiguous", "int8"):
            return cache.memory_bytes() // N
        try:  # paged: the pool's bytes over its token slots
            return cache.memory_bytes() // (math.ceil(N / BLOCK) * BLOCK)
        except Exception:  # noqa: BLE001
            return None


def check(name, out, ref):
    """Refuse to time a wrong answer."""
    diff = (out - ref).abs().max().item()
    tol = INT8_REL_TOL * ref.abs().max().item() if name == "int8" else FP32_TOL
    if not diff <= tol:
        sys.exit(f"{name} differs from the seed by {diff:.2e} > {tol:.2e}; refusing to time wrong answers")
    return diff


def interleaved(fns, rounds):
    """{name: [seconds]} over `rounds` rotated rounds (warm-up is the caller's)."""
    times = {name: [] for name in fns}
    results = {}
    for r in range(rounds):
        for name in rotated(list(fns), r):
            t0 = time.perf_counter()
            results[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times, results


def run_cell(cfg_name, N, rounds, names, log):
    cfg = CONFIGS[cfg_name]
    Q, K, V = inputs(cfg, N)
    contenders = {n: Contender(n, cfg) for n in names}
    load0, ticks0 = loadavg(), cpu_ticks()
    skipped = {}
    with torch.inference_mode():
        w = min(WARMUP_STEPS, N)
        short = {}
        for n, c in list(contenders.items()):  # warm-up + correctness on a short run
            try:
                short[n], _ = c.decode(Q, K, V, w)
                c.updates(K, V, w)
            except Exception as e:  # noqa: BLE001 - only the optional paged cache
                if n != "paged":
                    raise
                skipped[n] = f"{type(e).__name__}: {e}"
                del contenders[n]
                log(f"  paged: skipped - its API did not work here: {skipped[n]}")
        names = list(contenders)
        diffs = {n: check(n, short[n], short["seed"]) for n in names}
        # Q, K, V are deleted only after these lambdas have run (ruff cannot see that)
        decode_times, decode_out = interleaved(
            {n: (lambda c=c: c.decode(Q, K, V, N)) for n, c in contenders.items()},  # noqa: F821
            rounds,
        )
        update_times, _ = interleaved({n: (lambda c=c: c.updates(K, V, N)) for n, c in contenders.items()}, rounds)  # noqa: F821
    ref = decode_out["seed"][0]
    for n in names:  # the timed runs' answers, too
        diffs[n] = max(diffs[n], check(n, decode_out[n][0], ref))
    load1, cpu = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    bytes_per_token = {n: c.bytes_per_token(N) for n, c in contenders.items()}
    rows = {}
    for n in names:
        rows[n] = {
            "decode": summarize(decode_times[n]),
            "update": summarize(update_times[n]),
            "tail_step_s_last_round": decode_out[n][1],
            "bytes_per_token": bytes_per_token[n],
            "max_abs_diff_vs_seed": diffs[n],
        }
    for n, r in rows.items():
        r["decode_speedup_vs_seed"] = rows["seed"]["decode"]["median"] / r["decode"]["median"]
        r["update_speedup_vs_seed"] = rows["seed"]["update"]["median"] / r["update"]["median"]
        r["bytes_vs_fp32"] = (
            r["bytes_per_token"] / rows["seed"]["bytes_per_token"] if r["bytes_per_token"] is not None else None
        )
    del Q, K, V, decode_out
    gc.collect()
    log(
        f"  done {cfg_name} N={N:<5} rounds={rounds}  load {load0[0]:.2f} -> {load1[0]:.2f}"
        + (f"  cpu steal {cpu['steal_pct']}%" if cpu else "")
    )
    return {
        "config": cfg_name,
        **cfg,
        "N": N,
        "rounds": rounds,
        "loadavg_before": load0,
        "loadavg_after": load1,
        **cpu,
        "skipped": skipped,
        "decode_times_s": decode_times,
        "update_times_s": update_times,
        "results": rows,
    }


def results_table(cells):
    out = []
    for cell in cells:
        for i, (n, r) in enumerate(cell["results"].items()):
            label = f"{cell['config']} N={cell['N']}" if i == 0 else ""
            d, u = r["decode"], r["update"]
            out.append(
                [
                    label,
                    n,
                    f"{d['min']:.2f}",
                    f"{d['median']:.2f}",
                    f"{d['max']:.2f}",
                    f"{r['tail_step_s_last_round'] * 1e3:.3f}",
                    f"{r['decode_speedup_vs_seed']:.2f}x",
                    f"{u['median'] * 1e3:.1f}",
                    f"{r['update_speedup_vs_seed']:.1f}x",
                    r["bytes_per_token"],
                    f"{r['bytes_vs_fp32']:.3f}" if r["bytes_vs_fp32"] else "",
                    f"{r['max_abs_diff_vs_seed']:.1e}",
                ]
            )
    return table(
        [
            "cell",
            "contender",
            "total min s",
            "median s",
            "max s",
            "ms/step at end",
            "vs seed",
            "updates ms",
            "vs seed",
            "B/token",
            "vs fp32",
            "|diff|",
        ],
        out,
    )


def claims(cells):
    """The issue's bars at N=8192: contiguous decode >= 1.8x the seed, updates >= 50x, int8 <= 0.3x bytes."""
    checks = []
    for cell in cells:
        if cell["N"] != CLAIM_N:
            continue
        r = cell["results"]
        if "contiguous" in r:
            checks.append(
                {
                    "config": cell["config"],
                    "what": f"contiguous decode total >= {CLAIM_TOTAL}x seed",
                    "value": r["contiguous"]["decode_speedup_vs_seed"],
                    "holds": r["contiguous"]["decode_speedup_vs_seed"] >= CLAIM_TOTAL,
                }
            )
            checks.append(
                {
                    "config": cell["config"],
                    "what": f"contiguous updates alone >= {CLAIM_UPDATE:.0f}x cheaper",
                    "value": r["contiguous"]["update_speedup_vs_seed"],
                    "holds": r["contiguous"]["update_speedup_vs_seed"] >= CLAIM_UPDATE,
                }
            )
        if "int8" in r:
            checks.append(
                {
                    "config": cell["config"],
                    "what": f"int8 bytes/token <= {CLAIM_BYTES}x fp32",
                    "value": r["int8"]["bytes_vs_fp32"],
                    "holds": r["int8"]["bytes_vs_fp32"] <= CLAIM_BYTES,
                }
            )
    return checks


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=ints, default=[512, 2048, 8192], help="decode lengths N (default 512,2048,8192)")
    p.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default=list(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)} (default all)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per cell (default: 10 at N=512, 9 at 2048, 3 at 8192: min(10, max(3, 20000 // N)))",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="N=512, 2 rounds; saves nothing unless --out")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for kv_cache.json/.txt (default benchmarks/results; not written with --quick unless given)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds = [512], 2
    if args.out is None and not args.quick:
        args.out = Path(__file__).resolve().parent / "results"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = Log()
    env = environment()
    env["loadavg_before"], ticks0 = loadavg(), cpu_ticks()
    log(f"headwise KV-cache benchmark  {env['date']}")
    log(f"torch {env['torch']}  threads {env['threads']}  cpu {env['cpu_model']} ({env['cpu_count']} cores)")
    log(
        f"loadavg before {env['loadavg_before']}"
        + ("  ** busy machine (> 1.5): treat numbers with care **" if env["loadavg_before"][0] > 1.5 else "")
    )
    log("decode: B=1, one layer, fp32, inference_mode; per step append 1 token + attend 1 query over the cache")
    names = ["seed", "contiguous", "int8"]
    why_not = paged_available()
    if why_not:
        log(f"paged: skipped - {why_not}")
    else:
        names.append("paged")
    cells = []
    for cfg_name in args.configs:
        for N in args.sizes:
            rounds = args.rounds or min(10, max(3, 20000 // N))  # small cells are cheap: more rounds
            cells.append(run_cell(cfg_name, N, rounds, names, log))
    env["loadavg_after"] = loadavg()
    env.update(busy_and_steal(ticks0, cpu_ticks()))

    log("")
    log(
        "total s = whole N-step decode (update + attention); ms/step at end = mean of the last "
        f"{TAIL} steps (last round); updates ms = N appends alone; vs seed = median ratio, >1 is faster"
    )
    log(results_table(cells))
    log("")
    checks = claims(cells)
    for c in checks:
        log(f"claim [{c['config']}] {c['what']}: {'HOLDS' if c['holds'] else 'FAILS'} ({c['value']:.3g})")
    if not checks:
        log(f"claims: not checked, N={CLAIM_N} was not run")
    steal = f"  cpu steal {env['steal_pct']}% (time given to other VMs)" if "steal_pct" in env else ""
    log(f"loadavg after {env['loadavg_after']}{steal}")

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "kv_cache",
            "env": env,
            "config": {
                "configs": {n: CONFIGS[n] for n in args.configs},
                "sizes": args.sizes,
                "rounds": args.rounds or "min(10, max(3, 20000 // N))",
                "tail_steps": TAIL,
                "warmup_steps": WARMUP_STEPS,
                "paged": why_not or "included",
                "block_size": BLOCK,
                "dtype": "float32",
                "order": "interleaved, rotated each round, after a short warm-up run",
            },
            "cells": cells,
            "claims": checks,
        }
        (args.out / "kv_cache.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "kv_cache.txt").write_text(log.text())
        print(f"saved {args.out / 'kv_cache.json'} and kv_cache.txt")


if __name__ == "__main__":
    main()
