"""OpenMP's wait policy, as libgomp itself reports it (OMP_DISPLAY_ENV=VERBOSE prints what it
parsed when torch loads it), in fresh processes: the policy can only be set before torch loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import headwise

HEADWISE_CLI = Path(sys.executable).with_name("headwise")
SPIN_PASSIVE, SPIN_DEFAULT, SPIN_ACTIVE = "0", "300000", "30000000000"  # libgomp's three spin counts
SPIN_OURS = "2000"  # headwise's default: a short spin, then sleep (headwise/threads.py)


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run(
        args, env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env}, capture_output=True, text=True, timeout=120
    )


def wait_policy(proc: subprocess.CompletedProcess) -> str:
    """The policy libgomp took ('ACTIVE' or 'PASSIVE'; unset prints 'PASSIVE')."""
    found = re.findall(r"OMP_WAIT_POLICY = '(\w+)'", proc.stderr)
    assert len(found) == 1, f"libgomp printed its environment {len(found)} times:\n{proc.stderr}"
    return found[0]


def spin_count(proc: subprocess.CompletedProcess) -> str:
    """The spin count libgomp took (PASSIVE = 0, unset = 300000, ACTIVE = 3e10)."""
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    assert len(found) == 1, f"libgomp printed its environment {len(found)} times:\n{proc.stderr}"
    return found[0]


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], **env)


def test_import_headwise_then_torch_spins_briefly():
    proc = python("import headwise, torch; torch.ones(64, 64) @ torch.ones(64, 64)")
    assert spin_count(proc) == SPIN_OURS and wait_policy(proc) == "PASSIVE"  # libgomp prints unset as PASSIVE
    assert "ThreadWaitWarning" not in proc.stderr


def test_library_entry_points_spin_briefly():
    # the library's own first import of torch (headwise.load -> models) happens after the policy is set
    proc = python("import headwise; headwise.MultiHeadAttention(64, 4)(__import__('torch').randn(1, 3, 64))")
    assert spin_count(proc) == SPIN_OURS


def test_cli_entry_spins_briefly():
    # `headwise --help` builds the full parser, which imports torch; every subcommand gets the policy
    proc = run([str(HEADWISE_CLI), "--help"])
    assert spin_count(proc) == SPIN_OURS
    proc = run([sys.executable, "-m", "headwise.cli", "plan", "gpt2"])
    assert spin_count(proc) == SPIN_OURS


def test_serve_adds_active_beside_the_count():
    # the server's engines step in their own threads: without ACTIVE, libgomp cuts the count to 1,000
    # once it runs more threads than cores, which sleeps inside a decode step
    proc = run([str(HEADWISE_CLI), "serve", "--help"])
    assert spin_count(proc) == SPIN_OURS and wait_policy(proc) == "ACTIVE"
    proc = run([str(HEADWISE_CLI), "serve", "--help"], GOMP_SPINCOUNT="1000")  # a choice of the user's stays
    assert spin_count(proc) == "1000" and wait_policy(proc) == "PASSIVE"


def test_users_choice_wins():
    assert spin_count(python("import headwise, torch", OMP_WAIT_POLICY="ACTIVE")) == SPIN_ACTIVE
    proc = python("import headwise, torch", GOMP_SPINCOUNT="1000")
    assert spin_count(proc) == "1000" and wait_policy(proc) == "PASSIVE"  # nothing added to a choice
    assert spin_count(python("import headwise, torch", OMP_WAIT_POLICY="PASSIVE")) == SPIN_PASSIVE


def test_torch_first_warns_once_with_the_fix():
    proc = python("import torch, headwise, importlib; importlib.reload(headwise)")
    assert spin_count(proc) == SPIN_DEFAULT  # too late to change from Python: libgomp read it
    assert proc.stderr.count("ThreadWaitWarning") == 1
    assert "import headwise` before torch" in proc.stderr and "GOMP_SPINCOUNT=2000" in proc.stderr


def test_torch_first_with_a_chosen_policy_is_silent():
    proc = python("import torch, headwise", OMP_WAIT_POLICY="PASSIVE")
    assert spin_count(proc) == SPIN_PASSIVE
    assert "ThreadWaitWarning" not in proc.stderr


def test_dir_lists_the_lazy_names():
    names = dir(headwise)
    for name in ("load", "generate", "Engine", "SamplingParams", "MultiHeadAttention", "embed", "__version__"):
        assert name in names
    assert set(headwise.__all__) <= set(names)
    for name in headwise.__all__:  # each listed name really resolves
        assert getattr(headwise, name) is not None
