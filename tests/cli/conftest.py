"""Run `headwise` as a user does: a subprocess, its exit code, its stdout and stderr."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def headwise(*args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    """`python -m headwise.cli ARGS` with the test's environment (plus `env`)."""
    return subprocess.run(
        [sys.executable, "-m", "headwise.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        **kw,
    )


@pytest.fixture
def cli():
    return headwise
