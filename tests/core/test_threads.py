"""OpenMP's wait policy, as libgomp itself reports it (OMP_DISPLAY_ENV=VERBOSE prints what it
parsed when torch loads it), in fresh processes: the policy can only be set before torch loads.
The 11 processes start together in a module fixture (one a core at a time: each spends ~1.4 s
importing torch); each test reads the ones it names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import headwise

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


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def cli_then_torch(*args: str) -> list[str]:
    """The `headwise` command's entry (headwise.cli:main, as the console script calls it) with `args`,
    then torch loaded in the same process: `headwise --help` answers without torch now, so this is how
    a test sees the policy main() left for whatever a command loads later."""
    return python(
        "import sys\nfrom headwise.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules\nimport torch\ntorch.ones(64, 64) @ torch.ones(64, 64)"
    ) + list(args)


RUNS = {  # name -> (argv, environment added)
    "headwise then torch": (python("import headwise, torch; torch.ones(64, 64) @ torch.ones(64, 64)"), {}),
    "library entry": (
        python("import headwise; headwise.MultiHeadAttention(64, 4)(__import__('torch').randn(1, 3, 64))"),
        {},
    ),
    "cli help": (cli_then_torch("--help"), {}),
    "cli plan": (cli_then_torch("plan", "gpt2"), {}),
    "serve help": (cli_then_torch("serve", "--help"), {}),
    "serve help, user's count": (cli_then_torch("serve", "--help"), {"GOMP_SPINCOUNT": "1000"}),
    "user's active": (python("import headwise, torch"), {"OMP_WAIT_POLICY": "ACTIVE"}),
    "user's count": (python("import headwise, torch"), {"GOMP_SPINCOUNT": "1000"}),
    "user's passive": (python("import headwise, torch"), {"OMP_WAIT_POLICY": "PASSIVE"}),
    "torch first": (python("import torch, headwise, importlib; importlib.reload(headwise)"), {}),
    "torch first, passive": (python("import torch, headwise"), {"OMP_WAIT_POLICY": "PASSIVE"}),
}


@pytest.fixture(scope="module")
def ran():
    """name -> the finished process of RUNS[name], os.cpu_count() running at a time."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(run, argv, **env) for name, (argv, env) in RUNS.items()}
        return {name: f.result() for name, f in futures.items()}


def test_import_headwise_then_torch_spins_briefly(ran):
    proc = ran["headwise then torch"]
    assert spin_count(proc) == SPIN_OURS and wait_policy(proc) == "PASSIVE"  # libgomp prints unset as PASSIVE
    assert "ThreadWaitWarning" not in proc.stderr


def test_library_entry_points_spin_briefly(ran):
    # the library's own first import of torch (headwise.load -> models) happens after the policy is set
    assert spin_count(ran["library entry"]) == SPIN_OURS


def test_cli_entry_spins_briefly(ran):
    # main() sets the policy before anything imports torch (`headwise --help` itself no longer does)
    assert spin_count(ran["cli help"]) == SPIN_OURS
    assert spin_count(ran["cli plan"]) == SPIN_OURS


def test_serve_adds_active_beside_the_count(ran):
    # the server's engines step in their own threads: without ACTIVE, libgomp cuts the count to 1,000
    # once it runs more threads than cores, which sleeps inside a decode step
    proc = ran["serve help"]
    assert spin_count(proc) == SPIN_OURS and wait_policy(proc) == "ACTIVE"
    proc = ran["serve help, user's count"]  # a choice of the user's stays
    assert spin_count(proc) == "1000" and wait_policy(proc) == "PASSIVE"


def test_users_choice_wins(ran):
    assert spin_count(ran["user's active"]) == SPIN_ACTIVE
    proc = ran["user's count"]
    assert spin_count(proc) == "1000" and wait_policy(proc) == "PASSIVE"  # nothing added to a choice
    assert spin_count(ran["user's passive"]) == SPIN_PASSIVE


def test_torch_first_warns_once_with_the_fix(ran):
    proc = ran["torch first"]
    assert spin_count(proc) == SPIN_DEFAULT  # too late to change from Python: libgomp read it
    assert proc.stderr.count("ThreadWaitWarning") == 1
    assert "import headwise` before torch" in proc.stderr and "GOMP_SPINCOUNT=2000" in proc.stderr


def test_torch_first_with_a_chosen_policy_is_silent(ran):
    proc = ran["torch first, passive"]
    assert spin_count(proc) == SPIN_PASSIVE
    assert "ThreadWaitWarning" not in proc.stderr


def test_dir_lists_the_lazy_names():
    names = dir(headwise)
    for name in ("load", "generate", "Engine", "SamplingParams", "MultiHeadAttention", "embed", "__version__"):
        assert name in names
    assert set(headwise.__all__) <= set(names)
    for name in headwise.__all__:  # each listed name really resolves
        assert getattr(headwise, name) is not None
