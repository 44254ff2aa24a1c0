"""One claim: beside a request of 64 prompts x n=16 (1,024 sequences), another client's first token
comes within 1 s (issue 43: first come, first served, it waited 12.9 s p50 and its inter-token time
went from 5 to 130 ms).

An Engine over SmolLM2-135M-Instruct (the builtin GGUF as loaded by default; max_num_seqs 64,
max_num_batched_tokens 512, the defaults `headwise serve` uses), in this process. Rounds run three
contenders in an order rotated each round (benchmarks/_common.py), each timing one small request
("another client": a chat "Hi!", greedy, --small-tokens) from add to first token (TTFT) and its
mean inter-token time (TPOT):
  alone   the engine idle
  fair    beside the big request (64 prompts x n=16, --big-tokens each, client "A", one share); the
          small one from client "B" is sent once the big one holds every slot
  fcfs    the same, but the small one counted as part of the big request (client "A", its share):
          the scheduler then orders it first come, first served, as every request was before fair
          shares (runtime/fair.py) -- same code, same engine, only the share differs
The big request is aborted once the small one has finished (its blocks come back; the next round
starts on an idle engine with the prefix cache cleared). Printed: CPU model, threads, load average
before and after, min / median / max per contender.

--serve: the same through `headwise serve` (its app in this process, on 127.0.0.1, two API keys):
the big request is one POST /v1/completions of 64 prompts x n=16 with key A (the server queues
a prompt once the one before it has its first token), the small one a streamed chat with key B,
timed to its first content chunk; contenders alone and fair (a request of its own is never in
another's share over HTTP). Saves results/fair_share_serve.txt.

    .venv/bin/python benchmarks/fair_share.py                 # ~5-10 min on 2 cores; saves results/fair_share.txt
    .venv/bin/python benchmarks/fair_share.py --serve         # ~1 min
    .venv/bin/python benchmarks/fair_share.py --rounds 1 --big-tokens 8 --no-save   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_model, loadavg, rotated, summarize, table  # noqa: E402

import headwise  # noqa: E402
from headwise.runtime.threads import pin_threads  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fair_share.txt"
HI = [{"role": "user", "content": "Hi!"}]


def prompts(n: int) -> list[list[dict]]:
    topics = ["the sea", "a clock", "bread", "rain", "chess", "a bridge", "ink", "bees"]
    return [[{"role": "user", "content": f"Write a line about {topics[i % 8]} (#{i})."}] for i in range(n)]


def small_request(engine, params, **fair) -> tuple[float, float, int]:
    """-> (TTFT, TPOT) in seconds of one request added now, stepped by the engine's thread, and the
    engine steps that ended until its first token came (the one in flight when it was added included)."""
    times, steps, done = [], [], threading.Event()

    def on_piece(piece):
        if piece.token_ids:
            times.extend([time.perf_counter()] * len(piece.token_ids))
            steps.append(engine.core.counts["steps"])
        if piece.finish_reason is not None:
            done.set()

    t0, s0 = time.perf_counter(), engine.core.counts["steps"]
    engine.add_request(HI, params, on_piece=on_piece, **fair)
    if not done.wait(3600):
        raise RuntimeError("the small request did not finish within an hour")
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return times[0] - t0, tpot, steps[0] - s0


def run(engine, contender: str, args, small, big) -> tuple[float, float, int]:
    engine.cache.pool.clear_prefix_cache()
    if contender == "alone":
        return small_request(engine, small)
    rids = [
        engine.add_request(p, big, client="A", share="big", priority=0)
        for p in prompts(args.prompts)  # 64 x n=16: 1,024 sequences of one request
    ]
    while len(engine.scheduler.running) < engine.max_num_seqs:  # the big request holds every slot
        time.sleep(0.01)
    fair = dict(client="B") if contender == "fair" else dict(client="A", share="big")
    try:
        return small_request(engine, small, **fair)
    finally:
        for rid in rids:
            engine.abort(rid)


def serve(args):
    """-> (url, engine, stop) of `headwise serve`'s app over SmolLM2 with keys sk-a and sk-b, in this process."""
    import socket

    import uvicorn

    from headwise.serve import create_app, parse_config
    from headwise.serve.timeouts import timed_h11

    spec = {"source": "smollm2-135m-instruct", "max_num_batched_tokens": args.max_num_batched_tokens}
    app = create_app(parse_config({"server": {"api_keys": ["sk-a", "sk-b"], "api_key_env": ""}, "models": {"m": spec}}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", http=timed_h11(30.0, 60.0, True)))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    while not app.state.serve.runtimes["m"].state == "ready":
        time.sleep(0.2)

    def stop():
        server.should_exit = True

    return url, app.state.serve.runtimes["m"].engine, stop


def http_small(url, engine, args) -> tuple[float, float, int]:
    """(TTFT, TPOT, steps) of a streamed chat with key B, to its first content chunk."""
    import httpx

    body = {"model": "m", "messages": HI, "max_tokens": args.small_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    times, steps = [], None
    t0, s0 = time.perf_counter(), engine.core.counts["steps"]
    auth = {"Authorization": "Bearer sk-b"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                times.append(time.perf_counter())
                steps = engine.core.counts["steps"] - s0 if steps is None else steps
    return times[0] - t0, (times[-1] - times[0]) / max(1, len(times) - 1), steps


def serve_run(url, engine, contender: str, args) -> tuple[float, float, int]:
    import httpx

    engine.cache.pool.clear_prefix_cache()
    if contender == "alone":
        return http_small(url, engine, args)
    body = {"model": "m", "prompt": [f"Write a line about topic {i}." for i in range(args.prompts)], "n": args.n}
    body.update(max_tokens=args.big_tokens, temperature=0.8, ignore_eos=True)
    auth = {"Authorization": "Bearer sk-a"}
    big = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=3600))
    big.start()
    while len(engine.scheduler.running) < engine.max_num_seqs:  # the big request holds every slot
        time.sleep(0.01)
    try:
        return http_small(url, engine, args)
    finally:
        engine.abort_all()
        big.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--big-tokens", type=int, default=16)
    ap.add_argument("--small-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="the step's token budget")
    ap.add_argument("--contenders", default="alone,fair,fcfs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 if the load average > 1.5)")
    ap.add_argument("--serve", action="store_true", help="through headwise serve (alone, fair)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    load0 = loadavg()
    threads = args.threads or (1 if load0[0] > 1.5 else os.cpu_count() or 1)
    pin_threads(threads)
    budget = args.max_num_batched_tokens
    if args.serve:
        url, engine, stop = serve(args)
        names = [n for n in args.contenders.split(",") if n != "fcfs"]

        def one(name):
            return serve_run(url, engine, name, args)
    else:
        model = headwise.load("smollm2-135m-instruct")
        engine = headwise.Engine(model, max_num_seqs=64, max_num_batched_tokens=budget, max_waiting_requests=1024)
        engine.start()
        stop = engine.shutdown
        small = headwise.SamplingParams(temperature=0, max_new_tokens=args.small_tokens, ignore_eos=True)
        big = headwise.SamplingParams(temperature=0.8, n=args.n, max_new_tokens=args.big_tokens, ignore_eos=True)
        names = args.contenders.split(",")

        def one(name):
            return run(engine, name, args, small, big)

    one("alone")  # warm-up
    ttft: dict = {n: [] for n in names}
    tpot: dict = {n: [] for n in names}
    steps: dict = {n: [] for n in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            a, b, k = one(name)
            ttft[name].append(a)
            tpot[name].append(b)
            steps[name].append(k)
            print(f"round {r + 1} {name:5s}: TTFT {a * 1e3:9.1f} ms ({k} steps), TPOT {b * 1e3:7.1f} ms", flush=True)
    stop()
    rows = []
    for name in names:
        t, p = summarize(ttft[name]), summarize(tpot[name])
        rows.append([name] + [f"{t[k] * 1e3:.0f}" for k in ("min", "median", "max")])
        rows[-1] += [f"{p[k] * 1e3:.1f}" for k in ("min", "median", "max")]
        rows[-1] += ["/".join(str(k) for k in sorted(steps[name]))]
    head = ["contender", "TTFT min ms", "median", "max", "TPOT min ms", "median", "max", "TTFT in steps"]
    text = (
        f"fair_share{' through headwise serve' if args.serve else ''}: SmolLM2-135M-Instruct (builtin GGUF), "
        f"Engine max_num_seqs 64, max_num_batched_tokens {budget};\n"
        f"big request {args.prompts} prompts x n={args.n} ({args.prompts * args.n} sequences) x {args.big_tokens} "
        f"tokens; the small one: chat 'Hi!' greedy x {args.small_tokens} tokens; {args.rounds} rounds\n"
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, {threads} torch thread(s)\n"
        f"load average before {load0}, after {loadavg()}\n\n" + table(head, rows) + "\n"
    )
    print("\n" + text)
    if not args.no_save:
        path = RESULTS.with_name("fair_share_serve.txt") if args.serve else RESULTS
        path.write_text(text)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
