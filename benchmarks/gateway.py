"""One claim: replicas behind the gateway add throughput, and the gateway's own cost per request is
a few milliseconds (the figure LiteLLM publishes for itself: median and p99 added latency).

Processes, all `headwise serve` on 127.0.0.1, serving SmolLM2 (weights as stored):
  solo       one replica with every core (OMP_NUM_THREADS = cores)
  pair0/1    two replicas with half the cores each (cores // 2 threads)
  gw1        a gateway, [replicas.pool] urls = [solo]
  gw2        a gateway, [replicas.pool] urls = [pair0, pair1]
The gateways serve no model themselves. On a machine with few cores the replicas share them,
so 2 replicas cannot be 2x one (the issue says so): the comparison is the same cores split two
ways plus the routing, against one process with all of them.

1. Throughput: --clients C (default 32) streaming clients, the workload of serving.py (distinct
   random-token prompts of --input-len, --output-len new tokens, EOS ignored, greedy), through gw1
   and through gw2, rounds alternating which goes first.
2. Gateway overhead: --pairs N pairs of one small request sent straight to `solo` and the same
   request through gw1 (which sends it to `solo`), one request in flight at a time, the order
   within a pair alternating. Two kinds: a non-streamed 1-token completion (latency), and a
   streamed completion (time to first token). Overhead per pair = through gw1 - direct; the
   median and p99 of those, and of each side.

    .venv/bin/python benchmarks/gateway.py                      # full run; saves results/gateway.*
    .venv/bin/python benchmarks/gateway.py --quick --out gateway_quick   # a short run
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, table  # noqa: E402
from serving import MODEL, SERVER_ENV, Server, free_port, level_table, pct, run_level  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def serve(name: str, config: str, logdir: Path, threads: int | None = None) -> Server:
    path = logdir / f"{name}.toml"
    path.write_text(config)
    port = free_port()
    argv = [sys.executable, "-m", "headwise.cli", "serve", "--config", str(path), "--port", str(port)]
    argv += ["--log-level", "warning"]
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the child at import
    try:
        return Server(name, argv, port, logdir)
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def replica_config(max_num_seqs: int) -> str:
    return f'[server]\napi_key_env = ""\n[models."{MODEL}"]\nsource = "{MODEL}"\nmax_num_seqs = {max_num_seqs}\n'


def gateway_config(urls: list[str]) -> str:
    """A replica set, and a route under the model's own name (the gateway serves no model of that
    name), so clients send the same body to a gateway as to a replica."""
    listed = ", ".join(json.dumps(u) for u in urls)
    return (
        f'[server]\napi_key_env = ""\n[replicas.pool]\nurls = [{listed}]\nmodels = ["{MODEL}"]\n'
        f'[routes."{MODEL}"]\ntargets = ["pool/{MODEL}"]\nretries = 0\n'
    )


def overhead(direct: str, gateway: str, pairs: int, log: Log) -> dict:
    """Paired latencies of one small request, direct and through the gateway."""
    import httpx

    rng = random.Random(7)
    bodies = {
        "latency": {"prompt": "Hello", "max_tokens": 1, "temperature": 0},
        "ttft": {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True},
    }
    out = {}
    with httpx.Client(timeout=120) as client:

        def one(base: str, body: dict) -> float:
            t0 = time.perf_counter()
            if not body.get("stream"):
                r = client.post(base + "/v1/completions", json={**body, "model": MODEL})
                r.raise_for_status()
                return time.perf_counter() - t0
            with client.stream("POST", base + "/v1/completions", json={**body, "model": MODEL}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                        return time.perf_counter() - t0
            raise RuntimeError("no text came back")

        for kind, body in bodies.items():
            for _ in range(5):  # warm connections and caches on both paths
                one(direct, body)
                one(gateway, body)
            d, g = [], []
            for i in range(pairs):
                body_i = {**body, "prompt": f"{body['prompt']} {rng.randrange(10**6)}"}  # no prefix-cache advantage
                order = [(direct, d), (gateway, g)]
                for base, sink in order if i % 2 == 0 else order[::-1]:
                    sink.append(one(base, body_i))
            diff = [b - a for a, b in zip(d, g)]
            out[kind] = {
                "direct_ms": {"median": statistics.median(d) * 1e3, "p99": pct(d, 99) * 1e3},
                "gateway_ms": {"median": statistics.median(g) * 1e3, "p99": pct(g, 99) * 1e3},
                "overhead_ms": {"median": statistics.median(diff) * 1e3, "p99": pct(diff, 99) * 1e3},
                "pairs": pairs,
            }
            o = out[kind]
            log(
                f"  {kind:8s} direct med/p99 {o['direct_ms']['median']:.1f}/{o['direct_ms']['p99']:.1f} ms, "
                f"gateway {o['gateway_ms']['median']:.1f}/{o['gateway_ms']['p99']:.1f} ms, "
                f"overhead {o['overhead_ms']['median']:.2f}/{o['overhead_ms']['p99']:.2f} ms"
            )
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="requests per throughput level")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=200, help="request pairs per overhead kind")
    p.add_argument("--quick", action="store_true", help="8 clients, 16 requests of 32+32 tokens, 1 round, 40 pairs")
    p.add_argument("--out", default="gateway", help="results/<out>.txt and .json")
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.requests, a.input_len, a.output_len, a.rounds, a.pairs = 8, 16, 32, 32, 1, 40
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    log, env = Log(), environment()
    cores = os.cpu_count() or 2
    log(f"headwise gateway benchmark  {env['date']}")
    log(f"torch {env['torch']}  cpu {env['cpu_model']} ({cores} cores)  server env {SERVER_ENV}")
    log(f"command: {env['command']}")
    log(f"loadavg before {loadavg()}")
    log(
        f"workload: {args.input_len}-token random prompts, {args.output_len} new tokens (EOS ignored), greedy, "
        f"streamed; {args.clients} clients, {args.requests} requests a level; rounds {args.rounds}; "
        f"overhead pairs {args.pairs}"
    )
    half = max(1, cores // 2)
    with tempfile.TemporaryDirectory(prefix="hw-gateway-") as tmp:
        logdir = Path(tmp)
        seqs = max(args.clients, 16)
        replicas = {
            "solo": serve("solo", replica_config(seqs), logdir, cores),
            "pair0": serve("pair0", replica_config(seqs), logdir, half),
            "pair1": serve("pair1", replica_config(seqs), logdir, half),
        }
        gateways = {}
        try:
            for s in replicas.values():
                s.wait_ready()
            gateways["gw1"] = serve("gw1", gateway_config([replicas["solo"].url]), logdir)
            gateways["gw2"] = serve("gw2", gateway_config([replicas[n].url for n in ("pair0", "pair1")]), logdir)
            for s in gateways.values():
                s.wait_ready()
            log(f"replicas: solo {cores} threads, pair0/pair1 {half} threads each; gateways gw1 -> solo, gw2 -> pair")

            rng = random.Random(1234)
            prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.requests)]
            runs: dict[str, list[dict]] = {"gw1": [], "gw2": []}
            t0 = cpu_ticks()
            for r in range(args.rounds):
                for name in ("gw1", "gw2") if r % 2 == 0 else ("gw2", "gw1"):
                    res = asyncio.run(run_level(gateways[name].url, prompts, args.output_len, args.clients))
                    runs[name].append(res)
                    log(
                        f"  round {r + 1} {name} {args.clients} clients: {res['completed']}/{res['requests']} done, "
                        f"{res['output_throughput']:.1f} out tok/s, load {loadavg()}"
                    )
                    if res["errors"]:
                        log(f"    errors: {res['errors'][:3]}")
            log(f"cpu during throughput: {busy_and_steal(t0, cpu_ticks())}")
            best = {n: max(rs, key=lambda x: x["output_throughput"]) for n, rs in runs.items()}
            log("")
            log(level_table([(n, args.clients, best[n]) for n in ("gw1", "gw2")]))
            med = {n: statistics.median(x["output_throughput"] for x in rs) for n, rs in runs.items()}
            log(f"2 replicas / 1 replica, output tok/s (median over rounds): {med['gw2'] / med['gw1']:.2f}x")
            log("")
            log("gateway overhead (through gw1 - straight to solo, paired, one request at a time):")
            over = overhead(replicas["solo"].url, gateways["gw1"].url, args.pairs, log)
            rows = [
                [
                    k,
                    f"{o['direct_ms']['median']:.1f} / {o['direct_ms']['p99']:.1f}",
                    f"{o['gateway_ms']['median']:.1f} / {o['gateway_ms']['p99']:.1f}",
                    f"{o['overhead_ms']['median']:.2f} / {o['overhead_ms']['p99']:.2f}",
                ]
                for k, o in over.items()
            ]
            log(table(["request", "direct ms med/p99", "via gateway ms med/p99", "overhead ms med/p99"], rows))
            log(f"loadavg after {loadavg()}")
        finally:
            for s in [*gateways.values(), *replicas.values()]:
                s.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.txt").write_text(log.text())
    data = {"environment": env, "args": vars(args), "throughput": runs, "ratio_2_over_1": med["gw2"] / med["gw1"]}
    (RESULTS / f"{args.out}.json").write_text(json.dumps({**data, "overhead": over}, indent=1, default=str))
    print(f"saved {RESULTS / args.out}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
