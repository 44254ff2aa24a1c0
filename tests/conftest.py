import os
import tempfile

import pytest

import headwise  # noqa: F401  before torch: OpenMP threads wait passively (headwise/threads.py)
import torch
from hypothesis import HealthCheck, settings

# Converted-model cache of this test session, not the user's ~/.cache/headwise.
os.environ.setdefault("HEADWISE_CACHE", tempfile.mkdtemp(prefix="headwise-test-cache-"))

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
