"""One claim: `headwise serve` (continuous batching over a paged KV cache) serves many
clients far faster than one-request-at-a-time generation behind the same API.

Contenders, each a real server process on 127.0.0.1, driven over HTTP by the same client:
  headwise   `headwise serve --config <smollm2, max_num_seqs=64>` (the engine)
  baseline   a small FastAPI app (benchmarks/_baseline_server.py): transformers'
             LlamaForCausalLM built from the very same GGUF tensors (as benchmarks/decode.py
             does), `generate` with a token streamer, one request at a time behind a lock,
             the same /v1/completions SSE format
  llama.cpp  (--llama) llama.cpp's `llama-server -np <largest client count>` on the same GGUF file,
             the same threads, the same KV budget in tokens as headwise's pool (--kv-tokens, 32k by
             default: llama-server -c N, headwise num_blocks = N / 16; benchmarks/peers/llama_cpp.py
             builds it); the client sends it the same token-id prompts; its streamed chunks are one
             token each, so where its final chunk carries no usage the chunks are counted
and, at 1 client only, not a server:
  hw_generate  headwise.generate(prompt, greedy, ignore_eos) in a worker process
             (benchmarks/_worker.py, the same environment as the servers), one request after
             another, the same prompt and output lengths: what one client should get
Decode rate at 1 client, like with like: the streamed client's 1 / TPOT (TPOT excludes the
first token, so this is tokens after the first over the time they took) vs generate()'s
GenerationResult.tokens_per_second (the same ratio, timed inside the process); both the
median over the level's requests. Issue 13's target: headwise >= 0.9x hw_generate.
All three run with GOMP_SPINCOUNT=2000 (the short spin `import headwise` sets, headwise/core/threads.py;
libgomp's ~3 ms busy-wait starves the event loop thread of any server on 2 cores; results before
2026-12-01 were measured with OMP_WAIT_POLICY=PASSIVE) and torch's default threads.

Workload (vLLM benchmark_serving's random dataset): each request a distinct prompt of
--input-len random token ids (>= 17: no special tokens), --output-len new tokens with EOS
ignored, greedy, streamed with usage; all requests sent at once, at most C in flight
(`--max-concurrency` in vLLM terms), for C in --concurrency.
Metrics, as benchmark_serving defines them: TTFT (send -> first text chunk), TPOT ((E2E -
TTFT) / (output tokens - 1)), ITL (gaps between text chunks), E2E latency; request and
output-token throughput over the level's wall time; mean, median, p99. The baseline
serves one request at a time, so its throughput does not grow with C and a level takes
(requests x one request's time): by default it runs 1, 4 and 16 clients only
(--baseline-concurrency). Levels alternate contenders, the order rotated each round.
Memory (with --llama): each server's resident set (/proc/PID/smaps_rollup: Rss, split into
anonymous and file-backed pages) at start-up (/health 200, before any request) and after the
run (3 s after the last level), counted the same way for both: RSS = anonymous + file-backed
pages resident. llama-server mmaps its GGUF, so its weights count as file-backed pages it has
touched; headwise reads the weights into anonymous memory, and its file-backed pages are the
shared libraries (libtorch) it has touched. Both servers hold the same KV budget in tokens;
llama.cpp allocates (and clears) its K/V at start-up, headwise's pool becomes resident as it
fills. The target: headwise <= llama-server at both moments.

    .venv/bin/python benchmarks/serving.py            # full run, ~15 min here; saves results/serving.*
    .venv/bin/python benchmarks/serving.py --quick    # smoke test (32+32 tokens, 1/4/16 clients), nothing saved
    .venv/bin/python benchmarks/serving.py --llama --no-baseline --concurrency 1,16 --baseline-concurrency 1 \
        --out benchmarks/results/zen4/serving_llama          # `make bench-cpu`'s run: speed and memory vs llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import Log, busy_and_steal, cpu_ticks, environment, free_port, loadavg, table  # noqa: E402
from _worker import Worker  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEED = 1234
# what `headwise serve` sets (headwise/core/threads.py), for both servers
SERVER_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000"}
BASELINE = Path(__file__).resolve().parent / "_baseline_server.py"


# ------------------------------------------------------------------ processes
class Server:
    def __init__(self, name: str, argv: list[str], port: int, logdir: Path, cwd: Path = ROOT):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = (logdir / f"{name}.log").open("w")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV}, cwd=cwd
        )

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} server exited; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        sys.exit(f"{self.name} server not ready after {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_servers(logdir: Path, max_num_seqs: int, num_blocks: int | None = None) -> dict[str, Server]:
    config = logdir / "serve.toml"
    pool = f"num_blocks = {num_blocks}\n" if num_blocks else ""
    config.write_text(
        f'[server]\napi_key_env = ""\n[models."{MODEL}"]\nsource = "{MODEL}"\nmax_num_seqs = {max_num_seqs}\n{pool}'
    )
    hw_port, base_port = free_port(), free_port()
    servers = {
        "headwise": Server(
            "headwise",
            [
                sys.executable,
                "-m",
                "headwise.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(hw_port),
                "--log-level",
                "warning",
            ],
            hw_port,
            logdir,
        ),
        "baseline": Server("baseline", [sys.executable, str(BASELINE), "--port", str(base_port)], base_port, logdir),
    }
    for s in servers.values():
        s.wait_ready()
    return servers


def proc_memory(pid: int) -> dict:
    """A process's resident memory in bytes: rss (anonymous + file-backed pages resident), anon,
    file (/proc/PID/smaps_rollup: Rss and Anonymous)."""
    kib = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Anonymous:"):
                kib[parts[0]] = int(parts[1])
    rss, anon = kib["Rss:"] * 1024, kib["Anonymous:"] * 1024
    return {"rss": rss, "anon": anon, "file": rss - anon}


def pool_line(path: Path, wait_s: float = 10.0) -> str:
    """The "KV pool: ..." line `headwise serve` prints once its models have loaded."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        for line in path.read_text().splitlines():
            if "KV pool:" in line:
                return line.split(": ", 2)[-1]
        time.sleep(0.2)
    return "no KV pool line printed"


def memory_table(memory: dict) -> str:
    """Resident MiB of each server at each moment, and headwise / llama-server."""
    names = [n for n in ("headwise", "llama.cpp") if n in memory]
    head = [
        "moment",
        *(f"{n} RSS (anon + file) MiB" for n in names),
        *(["headwise / llama.cpp"] if len(names) == 2 else []),
    ]
    body = []
    for moment in ("start-up", "after the run"):
        row = [moment]
        for n in names:
            m = memory[n][moment]
            row.append(f"{m['rss'] / 2**20:.0f} ({m['anon'] / 2**20:.0f} + {m['file'] / 2**20:.0f})")
        if len(names) == 2:
            a, b = memory["headwise"][moment], memory["llama.cpp"][moment]
            row.append(f"{a['rss'] / b['rss']:.2f}x (anon {a['anon'] / b['anon']:.2f}x)")
        body.append(row)
    return table(head, body)


def llama_cpp_gguf() -> Path:
    """The file headwise serves: the builtin model's GGUF."""
    from headwise.models.builtin import resolve

    return resolve(MODEL)


# ------------------------------------------------------------------ the client
async def one_request(client, url: str, prompt: list[int], output_len: int) -> dict:
    """One streamed completion; a connection the server closed before answering (llama-server, now and
    then, on a kept-alive connection: "Server disconnected without sending a response") is tried once
    more on a new one, as the openai client does (max_retries), the time counted from the first try."""
    import httpx

    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    for attempt in (1, 2):
        out = {"ok": False, "chunks": [], "output_tokens": 0, "error": None, "retried": attempt > 1}
        try:
            return await _stream(client, url, body, output_len, out, t0)
        except httpx.RemoteProtocolError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            if out["chunks"]:  # it had begun answering: a lost stream, not a stale connection
                return out
        except Exception as e:  # a lost request is a result here, not a crash
            out["error"] = f"{type(e).__name__}: {e}"
            return out
    return out


async def _stream(client, url: str, body: dict, output_len: int, out: dict, t0: float) -> dict:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]
                return out
            if data.get("choices") and data["choices"][0].get("text"):
                out["chunks"].append(time.perf_counter() - t0)
            if data.get("usage"):
                out["output_tokens"] = data["usage"]["completion_tokens"]
    out["e2e"] = time.perf_counter() - t0
    out["output_tokens"] = out["output_tokens"] or len(out["chunks"])  # llama-server: a token a chunk
    out["ok"] = bool(out["chunks"]) and out["output_tokens"] == output_len
    if not out["ok"]:
        out["error"] = f"{out['output_tokens']} tokens instead of {output_len}"
    return out


async def run_level(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def gated(p):
            async with gate:
                return await one_request(client, url, p, output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        duration = time.perf_counter() - t0
    return summarize(results, duration)


def run_generate(worker: Worker, prompts: list[list[int]], output_len: int) -> dict:
    """headwise.generate on each prompt in turn (one client's workload without the server)."""
    t0 = time.perf_counter()
    replies = [worker.ask("decode", prompts=[p], new=output_len) for p in prompts]
    duration = time.perf_counter() - t0
    bad = [len(r["ids"][0]) for r in replies if len(r["ids"][0]) != output_len]
    return {
        "requests": len(prompts),
        "completed": len(prompts) - len(bad),
        "failed": len(bad),
        "errors": [f"{n} tokens instead of {output_len}" for n in bad],
        "duration_s": duration,
        "output_throughput": sum(len(r["ids"][0]) for r in replies) / duration,
        "decode_tok_s": stats([r["tok_s"] for r in replies]),
    }


def decode_rate(r: dict) -> float:
    """Tokens after the first per second, median request: 1 / p50 TPOT (a server), tokens_per_second (generate)."""
    return r["decode_tok_s"]["median"] if "decode_tok_s" in r else 1 / r["tpot_s"]["median"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": pct(xs, 99)}


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["chunks"][0] for r in ok]
    tpot = [(r["e2e"] - r["chunks"][0]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "retried": sum(r["retried"] for r in results),  # tried twice: the server closed the first connection
        "errors": sorted({str(r["error"])[:200] for r in results if not r["ok"]}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "itl_s": stats(itl),
        "e2e_s": stats([r["e2e"] for r in ok]),
    }


# ------------------------------------------------------------------ report
def ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def level_table(rows: list[tuple[str, int, dict]]) -> str:
    head = [
        "contender",
        "clients",
        "done/sent",
        "time s",
        "req/s",
        "out tok/s",
        "TTFT ms mean/med/p99",
        "TPOT ms mean/med/p99",
        "ITL ms mean/med/p99",
        "E2E s mean/med/p99",
    ]
    body = []
    for name, c, r in rows:

        def trio(k, f=ms):
            s = r[k]
            return "/".join(f(s[q]) for q in ("mean", "median", "p99"))

        body.append(
            [
                name,
                c,
                f"{r['completed']}/{r['requests']}",
                f"{r['duration_s']:.1f}",
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                trio("ttft_s"),
                trio("tpot_s"),
                trio("itl_s"),
                trio("e2e_s", lambda x: f"{x:.1f}"),
            ]
        )
    return table(head, body)


def verdicts(results: dict, runs: dict, log: Log) -> dict:
    hw, base = results["headwise"], results.get("baseline", {})
    out = {}

    def line(name, value, target, ok):
        out[name] = {"value": value, "target": target, "met": ok}
        log(f"  {'MET    ' if ok else 'NOT MET'} {name}: {value} (target {target})")

    if 1 in hw and 1 in results["hw_generate"]:
        r = decode_rate(hw[1]) / decode_rate(results["hw_generate"][1])
        paired = statistics.median(
            decode_rate(a) / decode_rate(b) for a, b in zip(runs["headwise"][1], runs["hw_generate"][1])
        )
        line(
            "headwise 1 client decode tok/s (1 / p50 TPOT) / generate() B=1 (p50 tokens_per_second)",
            f"{r:.2f}x (paired over rounds {paired:.2f}x)",
            ">= 0.9x",
            r >= 0.9,
        )

    if 1 in hw and 16 in hw:
        r = hw[16]["output_throughput"] / hw[1]["output_throughput"]
        line("headwise 16 clients / 1 client, output tok/s", f"{r:.2f}x", ">= 6x", r >= 6)
        t = hw[16]["tpot_s"]["median"] / hw[1]["tpot_s"]["median"]
        line("headwise p50 TPOT 16 clients / 1 client", f"{t:.2f}x", "< 4x", t < 4)
    llama = results.get("llama.cpp", {})
    if 1 in hw and 1 in llama:
        r = hw[1]["output_throughput"] / llama[1]["output_throughput"]
        line("headwise / llama-server at 1 client, output tok/s", f"{r:.2f}x", ">= 0.8x", r >= 0.8)
    if 16 in hw and 16 in llama:
        r = hw[16]["output_throughput"] / llama[16]["output_throughput"]
        line("headwise / llama-server -np 16 at 16 clients, output tok/s", f"{r:.2f}x", ">= 1.5x", r >= 1.5)
    mem = results.get("memory", {})
    if "headwise" in mem and "llama.cpp" in mem:
        for moment in ("start-up", "after the run"):
            r = mem["headwise"][moment]["rss"] / mem["llama.cpp"][moment]["rss"]
            line(
                f"headwise serve / llama-server resident memory (RSS) {'at ' * (moment == 'start-up')}{moment}, "
                "same KV budget in tokens",
                f"{r:.2f}x",
                "<= 1.0x",
                r <= 1.0,
            )
    if 16 in hw and 16 in base:
        r = hw[16]["output_throughput"] / base[16]["output_throughput"]
        line("headwise / baseline at 16 clients, output tok/s", f"{r:.2f}x", ">= 8x", r >= 8)
    for c in sorted(hw):
        if c >= 64:
            lost = hw[c]["failed"]
            line(f"headwise {c} clients: requests lost or failed", str(lost), "0", lost == 0)
    return out


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64], help="client counts (default 1,4,16,64)")
    p.add_argument(
        "--baseline-concurrency",
        type=ints,
        default=[1, 4, 16],
        help="client counts for the one-at-a-time baseline (default 1,4,16)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default: 3 at 1 client, else 2x clients, at most 64)",
    )
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="requests per baseline level (default: 3 at 1 client, else = clients)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="rounds over all levels (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine's max_num_seqs (default 64)")
    p.add_argument("--quick", action="store_true", help="32+32 tokens, 1/4/16 clients, nothing saved")
    p.add_argument(
        "--llama",
        action="store_true",
        help="add llama.cpp's llama-server as a contender (build it first: python benchmarks/peers/llama_cpp.py build)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline server")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads (headwise: torch's default)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=32768,
        help="with --llama: the KV budget in tokens both servers get (llama-server -c N, headwise num_blocks N/16; "
        "raised to every client's prompt + output where that is more); default 32768, llama-server's -c 32k",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.input_len, args.output_len, args.concurrency = 32, 32, [1, 4, 16]
        args.baseline_concurrency = [1, 4, 16]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    env = environment()
    env["loadavg_before"], ticks0 = loadavg(), cpu_ticks()
    log(f"headwise serving benchmark  {env['date']}")
    log(f"torch {env['torch']}  cpu {env['cpu_model']} ({env['cpu_count']} cores)  server env {SERVER_ENV}")
    log(
        f"loadavg before {env['loadavg_before']}"
        + ("  ** busy machine (> 1.5): treat numbers with care **" if env["loadavg_before"][0] > 1.5 else "")
    )
    log(
        f"workload: {args.input_len}-token random prompts, {args.output_len} new tokens (EOS ignored), greedy, "
        f"streamed; clients {args.concurrency} (baseline {args.baseline_concurrency}); rounds {args.rounds}"
    )
    rng = random.Random(SEED)

    def prompts(n):
        return [[rng.randrange(17, vocab) for _ in range(args.input_len)] for _ in range(n)]

    def n_requests(c, base):
        fixed = args.baseline_requests if base else args.requests
        if fixed:
            return fixed
        return 3 if c == 1 else (c if base else min(64, 2 * c) if c < 64 else c)

    contenders = ["headwise", *([] if args.no_baseline else ["baseline"]), *(["llama.cpp"] if args.llama else [])]
    plan = [
        (name, c)
        for c in sorted(set(args.concurrency) | set(args.baseline_concurrency))
        for name in contenders
        if c in (args.baseline_concurrency if name == "baseline" else args.concurrency)
    ]
    plan += [("hw_generate", 1)] if 1 in args.concurrency else []
    with tempfile.TemporaryDirectory(prefix="hw-serving-") as tmp:
        # threads 0: torch's default, as the servers have; the servers' environment
        # the weights the server loads (the default: the GGUF as stored), so generate() is like for like
        worker_env = {**os.environ, **SERVER_ENV, "HW_WORKER_WEIGHTS": "auto"}
        worker = Worker("hw_generate", ROOT, 0, Path(tmp) / "hw_generate.log", worker_env)
        info = worker.ask("info")
        vocab = info["vocab_size"]
        log(f"hw_generate worker: headwise from {info['headwise']}, {info['threads']} threads, env {info['wait_env']}")
        # the same KV budget in tokens for both engines (16-token blocks): --kv-tokens, or every client's
        # prompt + output where that is more (llama-server gives each of its -np slots -c / np tokens)
        budget = max(args.kv_tokens, max(args.concurrency) * (args.input_len + args.output_len + 16))
        budget = -(-budget // 16) * 16
        servers = start_servers(Path(tmp), args.max_num_seqs, num_blocks=budget // 16 if args.llama else None)
        log(f"headwise: {pool_line(Path(tmp) / 'headwise.log')}")
        if args.no_baseline:
            servers.pop("baseline").stop()
        stack = contextlib.ExitStack()
        if args.llama:
            from peers import llama_cpp

            log(f"llama.cpp {llama_cpp.build_info().get('version', '')}: -np {max(args.concurrency)} -c {budget}")
            servers["llama.cpp"] = stack.enter_context(
                llama_cpp.start_server(
                    llama_cpp_gguf(), args.threads, parallel=max(args.concurrency), ctx=budget, timeout_s=300
                )
            )
            env["llama_repack"] = servers["llama.cpp"].repack
            log(f"llama-server's repacked weights: {servers['llama.cpp'].repack}")
        memory: dict = {}
        for name in ("headwise", "llama.cpp"):
            if name in servers:  # at start-up: ready, no request yet
                memory[name] = {"start-up": proc_memory(servers[name].proc.pid)}
        try:
            for s in servers.values():  # warm-up: one short request each
                asyncio.run(run_level(s.url, prompts(1), 4, 1))
            run_generate(worker, prompts(1), 4)
            runs: dict[str, dict[int, list]] = {n: {} for n in [*contenders, "hw_generate"]}
            for rnd in range(args.rounds):
                for c in sorted({c for _, c in plan}):
                    names = [n for n, cc in plan if cc == c]
                    for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                        la = loadavg()[0]
                        batch = prompts(n_requests(c, name == "baseline"))
                        r = (
                            run_generate(worker, batch, args.output_len)
                            if name == "hw_generate"
                            else asyncio.run(run_level(servers[name].url, batch, args.output_len, c))
                        )
                        r["loadavg"] = [la, loadavg()[0]]
                        runs[name].setdefault(c, []).append(r)
                        log(
                            f"  round {rnd + 1} {name:11s} {c:3d} clients: {r['completed']}/{r['requests']} done, "
                            f"{r['output_throughput']:.1f} out tok/s, p50 decode {decode_rate(r):.1f} tok/s, "
                            f"load {la} -> {loadavg()[0]}"
                            + (f"  errors {r['errors']}" if r["errors"] else "")
                            + (f"  retried {r['retried']}" if r.get("retried") else "")
                        )
            time.sleep(3)  # idle, as a server between bursts (headwise trims its freed heap then: serve/memory.py)
            for name in memory:
                memory[name]["after the run"] = proc_memory(servers[name].proc.pid)
            log(
                f"resident memory, KV budget {budget} tokens"
                + (f" (llama-server -c {budget}, headwise num_blocks {budget // 16})" if args.llama else "")
                + ":\n"
                + memory_table(memory)
            )
        finally:
            for name, s in servers.items():
                if name != "llama.cpp":
                    s.stop()
            stack.close()
            worker.close()
    # the median round per level (by output throughput; hw_generate by its decode rate)
    key = {"hw_generate": decode_rate}
    results = {
        name: {
            c: sorted(rs, key=key.get(name, lambda r: r["output_throughput"]))[len(rs) // 2] for c, rs in levels.items()
        }
        for name, levels in runs.items()
    }
    results["memory"] = memory
    env["loadavg_after"] = loadavg()
    env.update(busy_and_steal(ticks0, cpu_ticks()))
    log("")
    rows = [
        (name, c, results[name][c]) for c in sorted({c for _, c in plan}) for name in contenders if c in results[name]
    ]
    log(level_table(rows))
    log("")
    hw1 = results["headwise"].get(1)
    for c in sorted(results["headwise"]):
        parts = []
        if hw1:
            parts.append(
                f"{results['headwise'][c]['output_throughput'] / hw1['output_throughput']:.2f}x its 1-client throughput"
            )
        if c in results.get("baseline", {}):
            ratio = results["headwise"][c]["output_throughput"] / results["baseline"][c]["output_throughput"]
            parts.append(f"{ratio:.2f}x the baseline's")
        log(f"headwise at {c} clients: " + ", ".join(parts))
    if 1 in results["hw_generate"]:
        one = {n: decode_rate(results[n][1]) for n in [*contenders, "hw_generate"] if 1 in results[n]}
        log(
            "decode at 1 client, tokens after the first per second, median request (servers: 1 / TPOT as the "
            "client sees it; hw_generate: generate()'s tokens_per_second): "
            + ", ".join(f"{n} {x:.1f}" for n, x in one.items())
        )
    log("targets:")
    v = verdicts(results, runs, log)
    steal = f"  cpu busy {env['busy_pct']}% steal {env['steal_pct']}%" if "steal_pct" in env else ""
    log(f"loadavg after {env['loadavg_after']}{steal}")
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving.json").write_text(
            json.dumps(
                {
                    "benchmark": "serving",
                    "env": env,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": runs,
                    "memory": memory,
                    "targets": v,
                },
                indent=1,
            )
            + "\n"
        )
        (args.out / "serving.txt").write_text(log.text())
        print(f"saved {args.out / 'serving.json'} and serving.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
