"""Issue 43's idle-connection flood on `headwise serve`: 20,000 connections that send the start of a
request and dribble one header byte now and then, from several loopback addresses (one address's
ports would do, but each flooding process holds its own 5,000 descriptors). Measured: /health's
latency from 127.0.0.1 (a new connection per probe, as monitoring probes do) before, during and
after the flood; what the flooders were answered (503 refusals at a cap, idle connections closed to
make room, 408 header timeouts); the server's open descriptors and connections.

The server is a real `headwise serve all-minilm-l6-v2` process with its default caps (from its
open-files limit). Two floods: "held" (what the server closes stays closed) and "persistent" (the
flooders reopen what the server closes after --reconnect seconds: a connect flood at the rate the server
answers).

    .venv/bin/python benchmarks/idle_connections.py          # ~2.5 min; results/idle_connections.txt
    .venv/bin/python benchmarks/idle_connections.py --connections 2000 --hold 10 --no-save
    .venv/bin/python benchmarks/idle_connections.py --sources 127.0.0.1   # the probe's own address floods
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_model, loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
START = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Dribble: "


def flooder(port: int, source: str, n: int, stop_at: float, dribble: float, reconnect: float, out) -> None:
    """Hold `n` connections from `source` until `stop_at`: each sends START, then one byte every
    `dribble` s; one the server answers or closes is reopened `reconnect` s later. Counts to `out`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    counts = dict.fromkeys(
        ("opened", "refused_503", "closed_idle_503", "timeout_408", "other_close", "connect_failed"), 0
    )
    counts["open_max"] = 0
    live: set[socket.socket] = set()
    due: list[float] = [time.monotonic()] * n  # when to open the next ones

    def open_one() -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            # the port is chosen at connect(), per destination: bind(port 0) scans for a port free for every
            # destination, slower with each socket bound to the address
            s.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
            s.bind((source, 0))
            err = s.connect_ex(("127.0.0.1", port))
        except OSError:
            err = -1
        if err not in (0, errno.EINPROGRESS):
            s.close()
            counts["connect_failed"] += 1
            due.append(time.monotonic() + reconnect)
            return
        sel.register(s, selectors.EVENT_WRITE, "connecting")

    def closed(s: socket.socket, kind: str) -> None:
        counts[kind] += 1
        sel.unregister(s)
        live.discard(s)
        s.close()
        due.append(time.monotonic() + reconnect)

    next_dribble = time.monotonic() + dribble
    while time.monotonic() < stop_at:
        now = time.monotonic()
        ready_now = [t for t in due if t <= now][:500]  # a few at a time: answers are read in between
        if ready_now:
            due.sort()
            del due[: len(ready_now)]
            for _ in ready_now:
                open_one()
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            if key.data == "connecting":
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    counts["connect_failed"] += 1
                    sel.unregister(s)
                    s.close()
                    due.append(time.monotonic() + reconnect)
                    continue
                try:
                    s.send(START)
                except OSError:
                    closed(s, "other_close")
                    continue
                sel.modify(s, selectors.EVENT_READ, "open")
                live.add(s)
                counts["opened"] += 1
                counts["open_max"] = max(counts["open_max"], len(live))
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 503") and b"connection_closed_idle" in data:
                closed(s, "closed_idle_503")
            elif data.startswith(b"HTTP/1.1 503"):
                closed(s, "refused_503")
            elif data.startswith(b"HTTP/1.1 408"):
                closed(s, "timeout_408")
            else:
                closed(s, "other_close")
        if time.monotonic() >= next_dribble:
            next_dribble += dribble
            for s in list(live):
                try:
                    s.send(b"a")
                except OSError:
                    pass
    counts["open_at_end"] = len(live)
    for s in live:
        s.close()
    out.put(counts)


PROBE = httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))  # a new connection each


def probe(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    try:
        r = PROBE.get(url + "/health")
        what = str(r.status_code)
    except httpx.HTTPError as e:
        what = type(e).__name__
    return time.perf_counter() - t0, what


def probes(url: str, seconds: float, every: float = 0.2) -> list[tuple[float, str]]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(probe(url))
        time.sleep(every)
    return out


def summary(name: str, rows: list[tuple[float, str]]) -> str:
    ok = sorted(t for t, what in rows if what == "200")
    bad: dict[str, int] = {}
    for _, what in rows:
        if what != "200":
            bad[what] = bad.get(what, 0) + 1
    ms = f"min {ok[0] * 1e3:.1f} / median {statistics.median(ok) * 1e3:.1f} / max {ok[-1] * 1e3:.1f} ms" if ok else "-"
    return f"{name:<7} /health: {len(ok)}/{len(rows)} answered 200, {ms}; not 200: {bad or 'none'}"


def server_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(url: str) -> dict[str, float]:
    """headwise_connections_* from /metrics ({} when the server does not have them, or refused)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = PROBE.get(url + "/metrics")
    if r.status_code != 200:
        return {}
    out = {}
    for f in text_string_to_metric_families(r.text):
        for s in f.samples:
            if s.name.startswith("headwise_connections"):
                out[s.name + ("{" + s.labels["key"] + "}" if "key" in s.labels else "")] = s.value
    return out


def flood_round(url: str, pid: int, args, reconnect: float | None) -> list[str]:
    """One flood: probes before, during and after it, what the flooders got, the server's descriptors."""
    name = "held (closed ones stay closed)" if reconnect is None else f"persistent (reopened after {reconnect:g} s)"
    lines = [
        f"-- flood {name}: {args.connections} connections from {args.sources}, a header byte every "
        f"{args.dribble:g} s, for {args.hold:g} s; probes from 127.0.0.1"
    ]
    before = probes(url, 4)
    sources = args.sources.split(",")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    stop_at = time.monotonic() + args.hold
    every = reconnect if reconnect is not None else float("inf")
    per = args.connections // len(sources)
    workers = [
        ctx.Process(target=flooder, args=(port_of(url), src, per, stop_at, args.dribble, every, q)) for src in sources
    ]
    for w in workers:
        w.start()
    fds_max, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                fds_max[0] = max(fds_max[0], server_fds(pid))
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    during = probes(url, args.hold - 2)
    during_metrics = metrics(url)
    counts = [q.get(timeout=120) for _ in workers]
    for w in workers:
        w.join()
    stop.set()
    time.sleep(2)
    after = probes(url, 4)
    after_metrics = metrics(url)
    rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024
    lines += [summary("before", before), summary("during", during), summary("after", after)]
    total = {k: sum(c[k] for c in counts) for k in counts[0] if k != "open_max"}
    lines.append(
        "flooders: "
        + ", ".join(f"{k} {v}" for k, v in total.items())
        + f"; most open at once (sum of per-process maxima) {sum(c['open_max'] for c in counts)}"
    )
    lines.append(f"server: at most {fds_max[0]} descriptors open during the flood; RSS after {rss} MiB")
    if during_metrics:
        lines.append("metrics near the end: " + ", ".join(f"{k} {v:.0f}" for k, v in during_metrics.items()))
    if after_metrics:
        lines.append(f"metrics after: headwise_connections_open {after_metrics['headwise_connections_open']:.0f}")
    return lines


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=20_000)
    ap.add_argument("--sources", default="127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5", help="flooders' addresses")
    ap.add_argument("--hold", type=float, default=40.0, help="seconds each flood lasts (header_timeout is 30 s)")
    ap.add_argument("--dribble", type=float, default=5.0, help="seconds between a connection's header bytes")
    ap.add_argument(
        "--reconnect", type=float, default=1.0, help="persistent flood: seconds before a closed connection is reopened"
    )
    ap.add_argument("--floods", default="held,persistent", help="which floods, in order")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open("/tmp/idle_connections_server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "headwise.cli", "serve", "all-minilm-l6-v2", "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    lines = [
        f"python benchmarks/idle_connections.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
        f"CPU: {cpu_model()}; load average at start {loadavg()}",
    ]
    try:
        deadline = time.monotonic() + 300
        while probe(url)[1] != "200":
            assert server.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(0.3)
        limits = Path(f"/proc/{server.pid}/limits").read_text().split("Max open files")[1].split()
        m = metrics(url)
        caps = (
            f"caps max_connections {m['headwise_connections_limit{max_connections}']:.0f}, "
            f"max_connections_per_client {m['headwise_connections_limit{max_connections_per_client}']:.0f}"
            if m
            else "default caps (not on /metrics: `headwise serve` does not register them there)"
        )
        lines.append(
            f"server: headwise serve all-minilm-l6-v2, open-files limit {limits[0]} (hard {limits[1]}); {caps}; "
            f"{server_fds(server.pid)} descriptors open at rest"
        )
        for flood in args.floods.split(","):
            lines += flood_round(url, server.pid, args, None if flood == "held" else args.reconnect)
            print("\n".join(lines[-7:]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    lines.append(f"load average at end {loadavg()}")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        out = ROOT / "benchmarks/results/idle_connections.txt"
        out.write_text(text + "\n")
        print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
