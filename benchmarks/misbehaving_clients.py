"""Two of issue 43's attacks on `headwise serve`, measured: (1) eight 3.8 MiB chat bodies (each a 400
after tokenizing) beside a one-line chat, the CPU pool in two lanes by size (as served) against one
lane (first come, first served, as before), interleaved round by round; (2) four streaming clients
that stop reading: seconds until the engine runs nothing and every KV block is free, and /health's
worst latency meanwhile.

An in-process server (uvicorn, the protocol `headwise serve` runs) over SmolLM2 on 127.0.0.1.

    .venv/bin/python benchmarks/misbehaving_clients.py            # ~2-3 min on 2 cores
    .venv/bin/python benchmarks/misbehaving_clients.py --rounds 5 --stall 10
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_model, loadavg  # noqa: E402

from headwise.serve import create_app, parse_config  # noqa: E402
from headwise.serve.openai import common  # noqa: E402
from headwise.serve.timeouts import timed_h11  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]


def serve(config: dict):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(parse_config(config)), log_config=None, http=timed_h11(30, 60)))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, server
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def tiny_chat(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 1}, timeout=300)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def fair_round(url: str, bodies: int, mib: float) -> float:
    """A one-line chat's seconds while `bodies` big ones are in the pool."""
    big = {"model": "m", "messages": [{"role": "user", "content": "attention heads " * int(mib * 2**20 / 16)}]}
    data = json.dumps(big).encode()
    threads = [
        threading.Thread(
            target=httpx.post, args=(url + "/v1/chat/completions",), kwargs={"content": data, "timeout": 600}
        )
        for _ in range(bodies)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the bodies are in
    took = tiny_chat(url)
    for t in threads:
        t.join()
    return took


def stalled(url: str, clients: int, stall: float) -> dict:
    """`clients` streams whose sockets never read -> seconds until none runs, /health's worst."""
    body = json.dumps(
        {"model": "m", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    ).encode()
    socks = []
    for _ in range(clients):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        socks.append(s)
    t0, worst, peak = time.perf_counter(), 0.0, 0
    metrics = {}
    while time.perf_counter() - t0 < 600:
        h0 = time.perf_counter()
        httpx.get(url + "/health", timeout=30)
        worst = max(worst, time.perf_counter() - h0)
        text = httpx.get(url + "/metrics").text
        metrics = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("headwise_engine_") and 'model="m"' in line
        }
        peak = max(peak, int(metrics.get("headwise_engine_kv_blocks_used", 0)))
        if time.perf_counter() - t0 > 1 and metrics.get("headwise_engine_running") == 0:
            break
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {
        "seconds_to_free": round(time.perf_counter() - t0, 1),
        "stall_timeout": stall,
        "peak_blocks_used": peak,
        "blocks_used_after": metrics.get("headwise_engine_kv_blocks_used"),
        "blocks_total": metrics.get("headwise_engine_kv_blocks_total"),
        "aborted": metrics.get(
            "headwise_engine_requests_aborted_total", metrics.get("headwise_engine_requests_aborted")
        ),
        "health_worst_s": round(worst, 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bodies", type=int, default=8)
    p.add_argument("--mib", type=float, default=3.8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--stall", type=float, default=5.0, help="[server] stall_timeout for part 2 (served: 30 s)")
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}; load average {loadavg()}")
    server = {"api_key_env": "", "max_body_bytes": 8 << 20, "stall_timeout": args.stall}
    url, _ = serve({"server": server, "models": {"m": {"source": "smollm2-135m-instruct", "max_input_chars": 8 << 20}}})
    alone = statistics.median(tiny_chat(url) for _ in range(5))
    if args.rounds == 0:  # part 2 only
        print(f"{args.clients} clients that stop reading:", stalled(url, args.clients, args.stall))
        return 0
    lanes = common._LANES
    two = lanes.pool  # as served: a small and a big lane per model
    one = lambda model, small: two(model, False)  # noqa: E731  (one lane: every job in the big one)
    runs: dict[str, list[float]] = {"two lanes": [], "one lane": []}
    for r in range(args.rounds):
        for mode in ["two lanes", "one lane"] if r % 2 == 0 else ["one lane", "two lanes"]:
            lanes.pool = two if mode == "two lanes" else one
            runs[mode].append(fair_round(url, args.bodies, args.mib))
            print(f"round {r} {mode:9s}: tiny chat {runs[mode][-1]:.2f} s beside {args.bodies} x {args.mib} MiB")
    lanes.pool = two
    print(f"tiny chat alone: median {alone:.3f} s")
    for mode, xs in runs.items():
        print(f"{mode:9s}: min {min(xs):.2f}  median {statistics.median(xs):.2f}  max {max(xs):.2f} s")
    ratios = [o / t for o, t in zip(runs["one lane"], runs["two lanes"])]
    print("one lane / two lanes, round by round: " + ", ".join(f"{x:.1f}x" for x in ratios))
    print(f"{args.clients} clients that stop reading:", stalled(url, args.clients, args.stall))
    print(f"load average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
