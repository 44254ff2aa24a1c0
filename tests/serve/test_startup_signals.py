"""`headwise serve` stopped while it starts (issue 43): SIGINT / SIGTERM at seeded random points
of the import and the loading, and a port another socket holds. Never an abort (`terminate
called`, `FATAL`, exit 134) or a traceback: one stderr line and exit 0 (SIGTERM) / 130 (SIGINT),
or, for a signal that came after the load, the graceful shutdown; a busy port is exit 2 with one
line and no banner. benchmarks/lifecycle.py runs the same 100 times."""

import random
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from headwise.cli.startup import PortError, bind
from headwise.serve.local import load_all

from .conftest import free_port


ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "headwise.cli"]


STOPPED = re.compile(r"headwise serve: stopped while (starting|loading) \((SIGINT|SIGTERM)\)")
CODES = {"SIGINT": 130, "SIGTERM": 0}


def serve(entry: list[str], port: int) -> subprocess.Popen:
    # --log-level warning: uvicorn's info lines off, so stderr holds only what went wrong or ours
    return subprocess.Popen(
        [*entry, "serve", "smollm2", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def interrupted(entry: list[str], sig: str, delay: float, after_banner: bool) -> dict:
    proc = serve(entry, free_port())
    banner = proc.stdout.readline() if after_banner else ""  # the port is bound, the models load next
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    return {"sig": sig, "delay": delay, "code": proc.returncode, "out": banner + out, "err": err}


def outcome(r: dict) -> str:
    """What happened; asserts it is one of the allowed outcomes."""
    err, lines = r["err"], r["err"].splitlines()
    where = f"{r['sig']} at {r['delay']:.2f} s: exit {r['code']}, stderr {err!r}"
    assert "terminate called" not in err and "FATAL" not in err and "Traceback" not in err, where
    if not lines:  # the signal came after the load: the graceful shutdown, as once serving
        assert r["code"] == 0 and "KV pool:" in r["out"], where
        return "served"
    assert len(lines) == 1, where
    m = STOPPED.fullmatch(lines[0])
    assert m and m.group(2) == r["sig"] and r["code"] == CODES[r["sig"]], where
    return m.group(1)


@pytest.fixture
def sigint_reaches_children():
    """A child inherits an ignored SIGINT (pytest run as a background job) and would never see it;
    a handled one becomes the default in the child."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_signals_while_the_models_load_end_in_one_line(sigint_reaches_children):
    rng = random.Random(43)
    plan = [(CLI, sig, rng.uniform(0.0, 0.4), True) for sig in ("SIGINT", "SIGTERM") * 3]  # from the banner on
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda p: interrupted(*p), plan))
    stages = [outcome(r) for r in runs]
    # smollm2 takes >= 0.4 s to load after the banner: most signals land in the load
    assert stages.count("loading") >= len(stages) // 2, stages


def test_signals_while_importing_end_in_one_line(sigint_reaches_children):
    rng = random.Random(7)
    plan = [(CLI, sig, rng.uniform(0.3, 1.5), False) for sig in ("SIGINT", "SIGTERM") * 2]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda p: interrupted(*p), plan))
    stages = [outcome(r) for r in runs]
    assert "starting" in stages, stages  # torch's import alone takes > 1.5 s


def test_a_busy_port_is_one_line_before_any_banner():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run(
            [*CLI, "serve", "smollm2", "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert r.returncode == 2, r.stderr
    assert r.stdout == "", r.stdout  # no banner announcing a URL that will never serve
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in lines[0]
    assert "--port" in lines[0] and "make run PORT=" in lines[0], lines[0]


def test_bind_names_what_to_change():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortError, match=rf"port {port} on 127.0.0.1 is already in use.*--port"):
            bind("127.0.0.1", port)
    with pytest.raises(PortError, match=r"--host 192\.0\.2\.1 is not an address of this machine"):
        bind("192.0.2.1", free_port())  # TEST-NET-1 (RFC 5737): never a local address
    sock = bind("127.0.0.1", port)  # free again once the holder closed
    with sock, socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # listening already: a client connects before uvicorn accepts


def test_a_stopped_loader_loads_no_further_model():
    import threading

    from headwise.serve.config import LocalModel
    from headwise.serve.local import LocalRuntime

    started, release, stop, done = threading.Event(), threading.Event(), threading.Event(), []
    loaded = []

    def loader(spec):
        loaded.append(spec.name)
        started.set()
        release.wait(10)
        raise ValueError("not a real model")

    runtimes = [LocalRuntime(LocalModel(name=n, source=f"/nowhere/{n}"), loader) for n in ("a", "b")]
    thread = load_all(runtimes, on_done=done.append, stop=stop)
    assert started.wait(10)
    stop.set()  # the server stops while "a" loads
    release.set()
    thread.join(10)
    assert loaded == ["a"] and done == []
    assert [rt.state for rt in runtimes] == ["failed", "stopped"]
