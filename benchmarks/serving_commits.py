"""One claim: `headwise serve` of this checkout streams to its clients at least as fast as an older
commit's, and one client gets (nearly) what generate() decodes alone.

Three contenders in one run, interleaved level by level, the order rotated each round:
  new          `headwise serve` of this working tree (or --new REV)
  base         `headwise serve` of --base REV (a git worktree under /tmp, its C kernels built,
               as benchmarks/compare_commits.py makes them)
  hw_generate  headwise.generate(prompt) of this checkout in a worker process (benchmarks/_worker.py),
               at 1 client only: what one client should get
Both servers run side by side (the same config: smollm2-135m-instruct, the GGUF as stored,
max_num_seqs 64) in benchmarks/serving.py's server environment, driven by its client (httpx,
streamed completions of --input-len random ids, --output-len new tokens, EOS ignored, greedy).
Per level: 1 client, decode rate (1 / p50 TPOT; generate(): tokens_per_second, p50); more
clients, output tok/s. Reported: min / median / max, ratios of medians and the median of the
same round's ratios ("paired": drift hits both), the CPU and its vector ISA, load and steal.

    .venv/bin/python benchmarks/serving_commits.py --base 817d12b            # 8 rounds, 1 and 16 clients
    .venv/bin/python benchmarks/serving_commits.py --base 817d12b --quick    # 2 rounds, 32 tokens; no save
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402,I001
from _worker import Worker  # noqa: E402
from compare_commits import checkout  # noqa: E402
from serving import MODEL, SERVER_ENV, Server, decode_rate, free_port, run_generate, run_level  # noqa: E402

SEED = 2468


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", required=True, help="the old commit (a hash or ref)")
    p.add_argument("--new", default=None, help="the new commit (default: this working tree, as it is now)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="2 rounds, 32 new tokens; nothing saved")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_commits")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.output_len = 2, 32
    return args


def start(name: str, path: str, config: Path, logdir: Path) -> Server:
    """`headwise serve` run from a checkout (python -m imports that checkout's headwise)."""
    port = free_port()
    argv = [sys.executable, "-m", "headwise.cli", "serve", "--config", str(config), "--port", str(port)]
    return Server(name, [*argv, "--log-level", "warning"], port, logdir, cwd=Path(path))


def main(argv=None) -> int:
    args = parse_args(argv)
    log, env = Log(), environment()
    env["loadavg_before"], ticks0 = loadavg(), cpu_ticks()
    sides = {"new": checkout(args.new), "base": checkout(args.base)}
    log(f"headwise serving, two commits  {env['date']}")
    log(f"torch {env['torch']}  cpu {env['cpu_model']} ({env['cpu_count']} cores)  loadavg {env['loadavg_before']}")
    for name, s in sides.items():
        log(f"  {name:4s} {s['label']} ({s['commit'][:12]}{', uncommitted changes' if s['dirty'] else ''})")
    log(
        f"workload: {args.input_len}-token random prompts, {args.output_len} new tokens (EOS ignored), greedy, "
        f"streamed; clients {args.concurrency}; rounds {args.rounds}"
    )
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory(prefix="hw-serving-commits-") as tmp:
        config = Path(tmp) / "serve.toml"
        config.write_text(f'[server]\napi_key_env = ""\n[models."{MODEL}"]\nsource = "{MODEL}"\nmax_num_seqs = 64\n')
        worker = Worker(
            "hw_generate",
            ROOT,
            0,
            Path(tmp) / "hw_generate.log",
            {**os.environ, **SERVER_ENV, "HW_WORKER_WEIGHTS": "auto"},
        )
        vocab = worker.ask("info")["vocab_size"]
        servers = {name: start(name, s["path"], config, Path(tmp)) for name, s in sides.items()}

        def prompts(n):
            return [[rng.randrange(17, vocab) for _ in range(args.input_len)] for _ in range(n)]

        runs: dict[str, dict[int, list[float]]] = {n: {} for n in [*servers, "hw_generate"]}
        try:
            for s in servers.values():
                s.wait_ready()
                asyncio.run(run_level(s.url, prompts(2), 8, 2))  # warm-up
            run_generate(worker, prompts(1), 8)
            for r in range(args.rounds):
                for c in args.concurrency:
                    names = [*servers, *(["hw_generate"] if c == 1 else [])]
                    for name in rotated(names, r):
                        batch = prompts(3 if c == 1 else 2 * c)
                        if name == "hw_generate":
                            x = decode_rate(run_generate(worker, batch, args.output_len))
                        else:
                            res = asyncio.run(run_level(servers[name].url, batch, args.output_len, c))
                            if res["failed"]:
                                sys.exit(f"{name}: {res['failed']} requests failed: {res['errors'][:3]}")
                            x = decode_rate(res) if c == 1 else res["output_throughput"]
                        runs[name].setdefault(c, []).append(x)
                    log(
                        f"  round {r + 1} {c:2d} clients: "
                        + ", ".join(f"{n} {runs[n][c][-1]:.1f}" for n in names)
                        + f"  (load {loadavg()[0]})"
                    )
        finally:
            for s in servers.values():
                s.stop()
            worker.close()
    env["loadavg_after"] = loadavg()
    env.update(busy_and_steal(ticks0, cpu_ticks()))
    rows, ratios = [], {}
    for c in args.concurrency:
        unit = "decode tok/s (1 / p50 TPOT)" if c == 1 else "output tok/s"
        for name in [n for n in runs if c in runs[n]]:
            s = summarize(runs[name][c])
            rows.append(
                [f"{name} {c} client{'s' * (c > 1)} {unit}", f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}"]
            )
        pairs = [("new", "base")] + ([("new", "hw_generate"), ("base", "hw_generate")] if c == 1 else [])
        for a, b in pairs:
            xa, xb = runs[a][c], runs[b][c]
            ratios[f"{a}/{b} c={c}"] = {
                "medians": statistics.median(xa) / statistics.median(xb),
                "paired": statistics.median(x / y for x, y in zip(xa, xb)),
            }
    log("")
    log(table(["contender", "min", "median", "max"], rows))
    log("")
    for k, v in ratios.items():
        log(f"{k}: {v['medians']:.3f}x (paired over rounds {v['paired']:.3f}x)")
    log(f"loadavg after {env['loadavg_after']}  cpu busy {env.get('busy_pct')}% steal {env.get('steal_pct')}%")
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "serving_commits",
            "env": env,
            "sides": sides,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        payload.update(runs=runs, ratios=ratios)
        (args.out / "serving_commits.json").write_text(json.dumps(payload, indent=1) + "\n")
        (args.out / "serving_commits.txt").write_text(log.text())
        print(f"saved {args.out / 'serving_commits.json'} and serving_commits.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
