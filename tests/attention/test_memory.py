"""Memory bounds: fused and tiled backends never hold the (T, S) score matrix.

Each measurement runs in a fresh process: it resets the kernel's peak-RSS mark
(/proc/self/clear_refs), runs one attention call and reads the peak (VmHWM);
peak minus the RSS before the call is the op's extra memory. (ru_maxrss would
not do: a child inherits its parent's peak across fork/exec.) The bound is 1/50 of one fp32 score matrix, B*H*T*S*4 bytes; the seed's
path holds at least that (scores, then softmax output, then the mask fill).
"""

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, torch
from headwise import attend

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

backend, T, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 12, T, 64) for _ in range(3))
small = [t[:, :, :256].contiguous() for t in (q, k, v)]
with torch.inference_mode():
    attend(*small, is_causal=causal, backend=backend)          # load kernels, thread pools
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                           # peak RSS := current RSS
    before = status("VmRSS:")
    out = attend(q, k, v, is_causal=causal, backend=backend)
    peak = status("VmHWM:")
print(json.dumps({"extra_bytes": peak - before, "finite": bool(torch.isfinite(out).all())}))
"""


def extra_memory(backend: str, T: int, causal: bool) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(T), "1" if causal else "0"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("causal", [True, False])
def test_extra_memory_at_8192_is_under_a_fiftieth_of_the_score_matrix(backend, causal):
    T = 8192
    score_matrix = 1 * 12 * T * T * 4  # 3 GiB in fp32
    got = extra_memory(backend, T, causal)
    assert got["finite"]
    assert got["extra_bytes"] <= score_matrix / 50, f"{backend}: {got['extra_bytes'] / 2**20:.1f} MiB extra"
