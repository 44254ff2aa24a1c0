import os
import shutil
import tempfile

import pytest

import headwise  # noqa: F401  before torch: OpenMP threads wait passively (headwise/threads.py)
import torch
from hypothesis import HealthCheck, settings

# Converted-model cache of this test session, not the user's ~/.cache/headwise; removed when the
# session ends (an fp32 SmolLM2 is ~625 MB there: left behind, they filled the disk).
_OWN_CACHE = None
if "HEADWISE_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["HEADWISE_CACHE"] = tempfile.mkdtemp(prefix="headwise-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Two cores here: keep torch from oversubscribing them when pytest runs.
torch.set_num_threads(min(2, os.cpu_count() or 1))

settings.register_profile(
    "headwise",
    deadline=None,
    max_examples=150,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "headwise"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_fp32():
    """SmolLM2-135M-Instruct, its GGUF dequantized to fp32, loaded once for the whole session: the
    reference model of tests/generation, tests/engine, tests/serve and tests/models. Read-only: a
    test that changes it (a hook) puts it back in a finally; one that prunes or edits weights loads
    its own."""
    return headwise.load("smollm2-135m-instruct", weights="fp32")
