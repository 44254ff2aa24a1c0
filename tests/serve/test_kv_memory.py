"""`headwise serve --kv-memory SIZE` and [models.NAME] kv_memory size the KV pool as
EngineConfig(memory_budget_bytes=...) does; the start-up line says what the engine holds; an idle
server hands its freed C heap back (serve/memory.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import headwise
from headwise.cli import build_parser
from headwise.engine import Engine, EngineConfig
from headwise.serve import parse_config
from headwise.serve.config import ConfigError, models_config, with_kv_memory

from .conftest import free_port, wait_healthy

MiB = 2**20
LINE = re.compile(
    r"headwise serve: (\S+): KV pool: ([\d,]+)(k?) tokens \(up to (\d+) sequences, each up to ([\d,]+) tokens\), "
    r"([\d.]+) GB (\w+), allocated as it fills"
)


def test_kv_memory_sizes_the_pool_as_the_engine_config_does(tiny_dir):
    model = headwise.load(str(tiny_dir))
    by_flag = with_kv_memory(models_config([str(tiny_dir)]), 3 * MiB)  # what --kv-memory 3MiB makes
    by_toml = parse_config({"models": {"tiny": {"source": str(tiny_dir), "kv_memory": "3MiB"}}})
    (spec,) = by_flag.models.values()
    assert spec.engine.memory_budget_bytes == by_toml.models["tiny"].engine.memory_budget_bytes == 3 * MiB
    engine = Engine(model, config=spec.engine)
    cfg, c = model.config, engine.config
    values_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, every layer and KV head
    elem = engine.cache.memory_bytes() // (c.num_blocks * c.block_size * values_per_token)  # the pool's dtype
    assert elem in (2, 4)  # 16-bit or fp32 K/V
    assert c.num_blocks == 3 * MiB // (values_per_token * elem * c.block_size)  # the whole blocks that fit
    assert c.memory_budget_bytes == 3 * MiB

    # a model's num_blocks still wins over the flag
    fixed = parse_config({"models": {"tiny": {"source": str(tiny_dir), "num_blocks": 7}}})
    assert Engine(model, config=with_kv_memory(fixed, 3 * MiB).models["tiny"].engine).config.num_blocks == 7


@pytest.mark.parametrize("value", ["lots", "0", "-1MiB", "3 parsecs"])
def test_a_bad_size_is_one_line_naming_the_flag_or_the_key(capsys, value):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", f"--kv-memory={value}"])  # the parser `headwise` runs
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--kv-memory" in line and repr(value) in line and "512MiB" in line, line
    with pytest.raises(ConfigError, match=r"\[models.x\] kv_memory = .* is not a memory size"):
        parse_config({"models": {"x": {"source": "smollm2", "kv_memory": value}}})


def test_both_keys_at_once_is_an_error():
    with pytest.raises(ConfigError, match="both kv_memory and memory_budget_bytes"):
        parse_config({"models": {"x": {"source": "smollm2", "kv_memory": "1GiB", "memory_budget_bytes": 2**30}}})


def test_the_start_up_line_is_the_engines_resolved_pool(tiny_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "headwise.cli", "serve", str(tiny_dir), "--kv-memory", "1MiB", "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "HEADWISE_API_KEYS": ""},
    )
    try:
        assert wait_healthy(
            f"http://127.0.0.1:{port}", 120, lambda: proc.poll() is None or pytest.fail(log.read_text())
        )
        deadline = time.monotonic() + 10
        while not (m := LINE.search(log.read_text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert m, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    name, tokens, k, seqs, each, gb, dtype = m.groups()
    engine = Engine(headwise.load(str(tiny_dir)), config=EngineConfig(memory_budget_bytes=MiB))
    c = engine.config
    assert name == tiny_dir.name
    assert int(tokens.replace(",", "")) * (1024 if k else 1) == c.num_blocks * c.block_size
    assert int(seqs) == c.max_num_seqs and int(each.replace(",", "")) == engine.max_model_len
    assert float(gb) == round(engine.cache.memory_bytes() / 1e9, 2)
    assert dtype == str(engine.cache.kv_dtype or engine.cache.dtype).removeprefix("torch.")


# Run in a process of its own: the suite's process has a heap of ~10 GB whose free lists take the
# 100 MiB without growing, and its in-process servers run IdleTrims of their own.
IDLE_TRIM_SCRIPT = r"""
import ctypes, json, time
from headwise.serve.memory import IdleTrim, malloc_trim, resident_bytes

MiB = 2**20
assert malloc_trim() and resident_bytes() is not None  # glibc and /proc: Linux, as served here
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
malloc_trim()
before = resident_bytes()
blocks = [libc.malloc(64 << 10) for _ in range(1601)]  # 100 MiB of 64 KiB blocks: the heap, not mmap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
pin = max(blocks)  # kept, above the others: free() alone cannot shrink the heap from its top
for b in blocks:
    if b != pin:
        libc.free(b)
held = resident_bytes()
busy = [True]
trim = IdleTrim(lambda: busy[0], interval=0.02).start()
time.sleep(0.3)
busy_trims, busy_rss = trim.trims, resident_bytes()
busy[0] = False
deadline = time.monotonic() + 5
while trim.trims == 0 and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"before": before, "held": held, "busy_trims": busy_trims, "busy_rss": busy_rss,
                  "idle_trims": trim.trims, "after": resident_bytes()}))
trim.stop()
libc.free(pin)
"""


def test_idle_trim_hands_the_freed_heap_back_only_when_idle():
    out = subprocess.run([sys.executable, "-c", IDLE_TRIM_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] - r["before"] > 80 * MiB, r  # glibc keeps what was freed
    assert r["busy_trims"] == 0 and r["busy_rss"] - r["before"] > 80 * MiB, r  # an engine stepping: left alone
    assert r["idle_trims"] >= 1, r
    assert r["after"] < r["before"] + 20 * MiB, r  # the 100 MiB went back to the OS
