"""`headwise backends`: which backend serves a request, and how fast each one is here.

A quick, honest side-by-side: every backend that can serve the shape runs on
the same inputs, interleaved round by round, checked against `math` first.
The full benchmark with baselines lives in benchmarks/attention.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def compare_backends(
    B=1, H=12, Hkv=None, T=512, S=None, D=64, causal=True, dtype="fp32", rounds=5, seed=0
) -> list[dict]:
    import torch

    from ..attention import attend, backends, explain

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    Hkv, S = Hkv or H, S or T
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(torch_dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(torch_dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(torch_dtype)
    kw = {"is_causal": causal}
    chosen = explain(q, k, v, **kw).chosen
    rows = []
    with torch.inference_mode():
        ref = attend(q, k, v, backend="math", **kw).float()
        runnable = []
        for name in backends():
            reasons = explain(q, k, v, backend=name, **kw).rejected.get(name)
            if reasons:
                rows.append({"backend": name, "skipped": "; ".join(reasons)})
                continue
            err = (attend(q, k, v, backend=name, **kw).float() - ref).abs().max().item()
            runnable.append(name)
            rows.append({"backend": name, "max_abs_err": err, "times": []})
        by_name = {r["backend"]: r for r in rows}
        for r in range(rounds):  # interleave: every backend once per round
            for name in runnable[r % len(runnable) :] + runnable[: r % len(runnable)]:
                t0 = time.perf_counter()
                attend(q, k, v, backend=name, **kw)
                by_name[name]["times"].append(time.perf_counter() - t0)
    for row in rows:
        if "times" in row:
            row["median_ms"] = 1e3 * statistics.median(row["times"])
            row["min_ms"], row["max_ms"] = 1e3 * min(row["times"]), 1e3 * max(row["times"])
            row["auto"] = row["backend"] == chosen
    return rows


def format_comparison(rows: list[dict], title: str) -> str:
    timed = [r for r in rows if "median_ms" in r]
    base = next((r["median_ms"] for r in timed if r["backend"] == "math"), None)
    lines = [title, f"{'backend':<9} {'median ms':>10} {'min':>8} {'max':>8} {'vs math':>8} {'max err':>9}"]
    for r in rows:
        if "median_ms" not in r:
            lines.append(f"{r['backend']:<9} skipped: {r['skipped']}")
            continue
        ratio = f"{base / r['median_ms']:.1f}x" if base else "-"
        mark = "  <- auto" if r["auto"] else ""
        lines.append(
            f"{r['backend']:<9} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['max_ms']:>8.2f} "
            f"{ratio:>8} {r['max_abs_err']:>9.1e}{mark}"
        )
    lines.append(f"load average {os.getloadavg()[0]:.2f}; 'vs math' = math time / backend time")
    return "\n".join(lines)


def add_cli(subparsers) -> argparse.ArgumentParser:
    from .argtypes import Formatter, positive_int

    p = subparsers.add_parser(
        "backends",
        help="compare attention backends on one shape (choice, accuracy, speed)",
        description="Run every attention backend that can serve the given shape on the same inputs, "
        "check it against the math reference, and time them interleaved round by round. "
        "The backend marked '<- auto' is the one attend(backend=\"auto\") picks for it.",
        epilog="example (GQA 32:8, bf16): headwise backends -H 32 --kv-heads 8 --dtype bf16",
        formatter_class=Formatter,
    )
    arg = p.add_argument
    arg("--batch", "-B", type=positive_int, default=1, help="batch size B")
    arg("--heads", "-H", type=positive_int, default=12, help="query heads H")
    arg(
        "--kv-heads",
        type=positive_int,
        default=None,
        help="key/value heads Hkv, dividing H (default: --heads; fewer = GQA/MQA)",
    )
    arg("--tokens", "-T", type=positive_int, default=512, help="query length T")
    arg("--keys", "-S", type=positive_int, default=None, help="key length S (default: --tokens)")
    arg("--head-dim", "-D", type=positive_int, default=64, help="head dim D")
    arg("--no-causal", action="store_true", help="bidirectional instead of causal")
    arg("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="dtype of q, k, v")
    arg("--rounds", type=positive_int, default=5, help="timed calls per backend, interleaved")
    p.set_defaults(func=run_backends)
    return p


def run_backends(args) -> int:
    if args.kv_heads and args.heads % args.kv_heads:
        from .argtypes import fail

        return fail(
            "headwise backends",
            f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}: "
            f"key/value heads must divide the query heads (e.g. --kv-heads "
            f"{next(d for d in range(args.kv_heads, 0, -1) if args.heads % d == 0)})",
        )
    rows = compare_backends(
        args.batch,
        args.heads,
        args.kv_heads,
        args.tokens,
        args.keys,
        args.head_dim,
        not args.no_causal,
        args.dtype,
        args.rounds,
    )
    title = (
        f"attention B={args.batch} H={args.heads} Hkv={args.kv_heads or args.heads} T={args.tokens} "
        f"S={args.keys or args.tokens} D={args.head_dim} {'bidirectional' if args.no_causal else 'causal'} "
        f"{args.dtype}"
    )
    print(format_comparison(rows, title))
    return 0
