"""One claim: a maximal embeddings request does not stall the others. While one request of
2,048 inputs (up to the 300k-token limit) runs, small embeddings requests wait for at most one
micro-batch of it, and chat requests (another model, the engine's thread) start as usual.

A real `headwise serve --config` process (SmolLM2 + MiniLM) on 127.0.0.1. The large request
runs for --seconds (then the client leaves, which ends it after the batch in progress);
meanwhile one small embeddings request ("a cat") every 0.5 s and one streamed chat request
(max_tokens 1) every 2 s, each timed from send to answer / first chunk. Printed: CPU model,
load average, p50 and max of both, and the large request's progress. Before micro-batching,
the model was held for the whole large request: a small request sent after it waited minutes.

    .venv/bin/python benchmarks/embed_fairness.py              # ~1-2 min; saves results/embed_fairness.txt
    .venv/bin/python benchmarks/embed_fairness.py --seconds 20 --no-save
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_model, free_port, loadavg  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "embed_fairness.txt"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=2048)
    p.add_argument(
        "--words",
        type=int,
        default=120,
        help="words per input (~1.2 tokens each; 2,048 x 120 words is about the 300k-token limit)",
    )
    p.add_argument(
        "--seconds", type=float, default=60.0, help="how long the large request runs before the client leaves"
    )
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="embed-fairness-"))
    config = workdir / "serve.toml"
    config.write_text(
        '[server]\napi_key_env = ""\nmax_body_bytes = 16777216\n'
        '[models.smollm2]\nsource = "smollm2-135m-instruct"\n'
        '[models.minilm]\nsource = "all-minilm-l6-v2"\n'
    )
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headwise.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (workdir / "server.log").read_text()
            time.sleep(0.5)
        words = "multi head attention layers read the keys and values of every position".split()
        inputs = [" ".join(words[(i + j) % len(words)] for j in range(args.words)) for i in range(args.inputs)]
        with httpx.Client(base_url=url, timeout=60) as c:  # warm both models
            c.post("/v1/embeddings", json={"model": "minilm", "input": inputs[:16]}).raise_for_status()
            c.post(
                "/v1/chat/completions",
                json={"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
            ).raise_for_status()

        load_before = loadavg()
        large: dict = {}
        stop = threading.Event()

        def run_large():
            t0 = time.perf_counter()
            try:
                r = httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": inputs}, timeout=args.seconds)
                large.update(
                    status=r.status_code,
                    seconds=time.perf_counter() - t0,
                    tokens=r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None,
                    error=None if r.status_code == 200 else r.text[:300],
                )
            except httpx.TimeoutException:
                large.update(status="still running (client left)", seconds=time.perf_counter() - t0)

        def small_embeddings(out):
            with httpx.Client(base_url=url, timeout=args.seconds + 10) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        c.post("/v1/embeddings", json={"model": "minilm", "input": "a cat"}).raise_for_status()
                    except httpx.TimeoutException:  # stuck behind the large one: counted at its wait
                        out.append(time.perf_counter() - t0)
                        return
                    out.append(time.perf_counter() - t0)
                    stop.wait(0.5)

        def chat_ttft(out):
            body = {
                "model": "smollm2",
                "max_tokens": 1,
                "stream": True,
                "messages": [{"role": "user", "content": "Say hi."}],
            }
            with httpx.Client(base_url=url, timeout=args.seconds + 10) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    first = None
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        for line in r.iter_lines():  # read to the end: [DONE]
                            if (
                                first is None
                                and line.startswith("data: ")
                                and '"content":"' in line
                                and '"content":""' not in line
                            ):
                                first = time.perf_counter() - t0
                    if first is not None:
                        out.append(first)
                    stop.wait(2.0)

        small, ttft = [], []
        big = threading.Thread(target=run_large)
        big.start()
        time.sleep(2.0)  # the large request is being tokenized / embedded
        workers = [
            threading.Thread(target=small_embeddings, args=(small,)),
            threading.Thread(target=chat_ttft, args=(ttft,)),
        ]
        for w in workers:
            w.start()
        big.join()
        stop.set()
        for w in workers:
            w.join()
        lines = [
            "embed_fairness: small requests while one maximal embeddings request runs",
            f"date: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC",
            f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average before {load_before}, after {loadavg()}",
            f"large request: {args.inputs} inputs x {args.words} words; {large}",
            f"small embeddings ('a cat', every 0.5 s): n={len(small)} p50={percentile(small, 0.5) * 1e3:.0f} ms "
            f"max={max(small, default=float('nan')) * 1e3:.0f} ms",
            f"chat TTFT (smollm2, streamed, every 2 s): n={len(ttft)} p50={percentile(ttft, 0.5) * 1e3:.0f} ms "
            f"max={max(ttft, default=float('nan')) * 1e3:.0f} ms",
        ]
        if small:
            lines.append(
                f"small embeddings median {statistics.median(small) * 1e3:.0f} ms vs the large request's "
                f"{large.get('seconds', float('nan')):.1f} s"
            )
        text = "\n".join(lines) + "\n"
        print(text, end="")
        if not args.no_save:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(text)
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
