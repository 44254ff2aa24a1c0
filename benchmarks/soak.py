"""Soak: does `headwise serve` hold its memory flat under mixed traffic with clients that
hang up, and serve 128 streaming clients at once without a failure?

One real server process (SmolLM2 for chat/completions, MiniLM for embeddings), driven over
HTTP by this script:
  1. warm-up: --warmup mixed requests (the first requests allocate scratch buffers, pools,
     caches that then stay; growth is measured from after them);
  2. soak: --requests mixed requests, --concurrency at a time, in rotation: a streamed chat,
     a non-streamed completion, a stream the client drops after 2 events, a stream the
     client drops before its first byte, an embeddings request; the server's RSS is read
     from /proc every 20%;
  3. burst: --streams streaming clients at once, every one must end with its tokens and [DONE].
Then: RSS growth over the soak (< 5% passes), failures (must be 0), and the engine's own
counters from /metrics (nothing running or waiting, every KV block free).

    .venv/bin/python benchmarks/soak.py            # ~5 min here; saves benchmarks/results/soak.txt
    .venv/bin/python benchmarks/soak.py --quick    # 100 requests, 32 streams, nothing saved
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Log, cpu_model, free_port, loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT, EMBED = "smollm2", "minilm"
KINDS = ("stream", "complete", "drop_mid", "drop_early", "embed")
WORDS = (
    "attention",
    "heads",
    "cache",
    "river",
    "bank",
    "music",
    "python",
    "engine",
    "stream",
    "token",
    "garden",
    "planet",
    "winter",
    "coffee",
    "market",
    "bridge",
)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def isa() -> str:
    import torch

    from headwise.kernels import kernels_unavailable

    why = kernels_unavailable()
    return f"PyTorch CPU capability {torch.backends.cpu.get_cpu_capability()}; headwise small-row kernel: " + (
        "in use (AVX2+FMA)" if why is None else f"off ({why})"
    )


def prompt(rng: random.Random, i: int) -> str:
    return f"Request {i}: write about " + " and ".join(rng.sample(WORDS, 3)) + "."


async def one(client, kind: str, i: int, rng: random.Random, max_tokens: int) -> str | None:
    """Run one request of this kind; None if it went as it should, else what went wrong."""
    text = prompt(rng, i)
    if kind == "embed":
        r = await client.post("/v1/embeddings", json={"model": EMBED, "input": [text, text[::-1]]})
        ok = r.status_code == 200 and len(r.json()["data"]) == 2
        return None if ok else f"embed: HTTP {r.status_code} {r.text[:200]}"
    if kind == "complete":
        r = await client.post(
            "/v1/completions",
            json={"model": CHAT, "prompt": text, "max_tokens": max_tokens, "temperature": 0.7, "seed": i},
        )
        return (
            None
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            else f"complete: HTTP {r.status_code} {r.text[:200]}"
        )
    body = {
        "model": CHAT,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "drop_early":  # hang up before the first byte can have come

        async def send():
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                await r.aread()

        task = asyncio.ensure_future(send())
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a finished request is fine too
            return f"drop_early: {type(e).__name__}: {e}"
        return None
    events, done = 0, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"{kind}: HTTP {r.status_code} {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                return f"{kind}: error event {data['error']}"
            events += 1
            if kind == "drop_mid" and events == 2:
                return None  # leaving the block closes the connection mid-stream
    return None if done else f"{kind}: the stream ended without [DONE]"


async def mixed(url: str, n: int, start: int, concurrency: int, max_tokens: int, seed: int, on_progress=None):
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    failures, counts, finished = [], {k: 0 for k in KINDS}, 0
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def gated(i):
            nonlocal finished
            kind = KINDS[i % len(KINDS)]
            async with gate:
                try:
                    err = await one(client, kind, i, rng, max_tokens)
                except Exception as e:  # noqa: BLE001 - a lost request is a result here
                    err = f"{kind}: {type(e).__name__}: {e}"
            counts[kind] += 1
            if err:
                failures.append(err)
            finished += 1
            if on_progress:
                on_progress(finished)

        await asyncio.gather(*(gated(start + i) for i in range(n)))
    return counts, failures


async def burst(url: str, n: int, max_tokens: int) -> tuple[list[str], float]:
    import httpx

    failures = []
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def stream(i):
            body = {
                "model": CHAT,
                "prompt": f"Client {i} says hello to",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tokens, done = 0, False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return f"HTTP {r.status_code} {(await r.aread())[:200]!r}"
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                            if "error" in data:
                                return f"error event {data['error']}"
                            if data.get("usage"):
                                tokens = data["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
            return None if done and tokens == max_tokens else f"{tokens} tokens, [DONE]={done}"

        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(i) for i in range(n)))
        failures = [r for r in results if r]
        return failures, time.perf_counter() - t0


def engine_gauges(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith("headwise_engine_") and s.labels.get("model") == CHAT:
                out[s.name[len("headwise_engine_") :]] = s.value
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="100 requests, 32 streams; nothing saved")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.txt"))
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.warmup, a.streams = 100, 25, 32
    log = Log()
    import torch

    log(
        f"soak: {a.requests} mixed requests ({', '.join(KINDS)}; {a.concurrency} at a time, max_tokens "
        f"{a.max_tokens}) after {a.warmup} warm-up ones, then {a.streams} streaming clients at once"
    )
    log(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {isa()}; torch {torch.__version__}")
    log(f"load average before: {loadavg()}")

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    port = free_port()
    config = tmp / "serve.toml"
    config.write_text(
        f'[server]\napi_key_env = ""\n[models.{CHAT}]\nsource = "smollm2-135m-instruct"\n'
        f'max_num_seqs = 64\nmax_waiting_requests = 512\n[models.{EMBED}]\nsource = "all-minilm-l6-v2"\n'
    )
    server_log = (tmp / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headwise.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=server_log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    url = f"http://127.0.0.1:{port}"
    code = 1
    try:
        import httpx

        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                sys.exit(f"server exited; see {server_log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                sys.exit("server not ready after 600 s")
            time.sleep(0.5)
        rss_loaded = rss_mb(proc.pid)
        log(f"server RSS after loading: {rss_loaded:.0f} MB")

        t0 = time.perf_counter()
        counts, fail_w = asyncio.run(mixed(url, a.warmup, 0, a.concurrency, a.max_tokens, seed=1))
        rss0 = rss_mb(proc.pid)
        log(
            f"warm-up: {a.warmup} requests in {time.perf_counter() - t0:.0f} s, {len(fail_w)} failed; RSS {rss0:.0f} MB"
        )

        marks, step = [], max(1, a.requests // 5)

        def progress(done):
            if done % step == 0:
                marks.append((done, rss_mb(proc.pid)))

        t0 = time.perf_counter()
        counts, failures = asyncio.run(
            mixed(url, a.requests, a.warmup, a.concurrency, a.max_tokens, seed=2, on_progress=progress)
        )
        soak_s = time.perf_counter() - t0
        time.sleep(1.0)  # let the last aborts land
        rss1 = rss_mb(proc.pid)
        growth = 100 * (rss1 - rss0) / rss0
        log(
            f"soak: {a.requests} requests in {soak_s:.0f} s ({a.requests / soak_s:.1f} req/s): "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
            + f"; {len(failures)} failed"
        )
        log("  RSS by requests done: " + ", ".join(f"{d}: {m:.0f} MB" for d, m in marks))
        log(f"  RSS {rss0:.0f} -> {rss1:.0f} MB: {growth:+.2f}% (< 5% passes)")
        for f in failures[:10]:
            log(f"  failure: {f}")
        g = engine_gauges(url)
        idle = g.get("running") == 0 and g.get("waiting") == 0 and g.get("kv_blocks_used") == 0
        log(
            f"  engine after the soak: running {g.get('running'):.0f}, waiting {g.get('waiting'):.0f}, "
            f"KV blocks used {g.get('kv_blocks_used'):.0f} of {g.get('kv_blocks_total'):.0f}, "
            f"aborted {g.get('requests_aborted'):.0f}, finished {g.get('requests_finished'):.0f}, "
            f"prefill tokens {g.get('prefill_tokens', float('nan')):.0f}"
        )

        burst_fail, burst_s = asyncio.run(burst(url, a.streams, a.max_tokens))
        rss2 = rss_mb(proc.pid)
        log(
            f"burst: {a.streams} streaming clients at once, {a.max_tokens} tokens each, in {burst_s:.0f} s: "
            f"{len(burst_fail)} failed; RSS {rss2:.0f} MB"
        )
        for f in burst_fail[:10]:
            log(f"  failure: {f}")
        log(f"load average after: {loadavg()}")
        ok = growth < 5 and not failures and not burst_fail and idle
        log(
            f"verdict: RSS growth {growth:+.2f}% {'<' if growth < 5 else '>='} 5%, {len(failures)} soak failures, "
            f"{len(burst_fail)} burst failures, engine idle: {idle} -> {'PASS' if ok else 'FAIL'}"
        )
        code = 0 if ok else 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if not a.quick:
        Path(a.out).write_text(log.text())
        print(f"saved {a.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
