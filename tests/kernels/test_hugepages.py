"""kernels/hugepages.py: the packed weights' buffers in 2 MiB pages where THP allows, plain memory
where it does not; either way the same groups (unpack_rows gives the file's blocks back) and the same
products as the gguf package's weights."""

import mmap

import pytest
import torch

from headwise.kernels import hugepages, quant

from .test_quant_linear import assert_close, quantized_x

O, I, FMT = 256, 4096, "q4_k"  # 256 x 2304 bytes of Q4_K: 0.56 MiB (MIN_BYTES lowered to take the route)


class _NoMadvise(mmap.mmap):
    def madvise(self, *args):
        raise OSError("madvise refused")


def _refuse(*args, **kwargs):
    raise OSError("no anonymous mappings here")


def test_huge_empty_is_a_writable_buffer_of_the_size_asked():
    n = 2 * hugepages.HUGE_PAGE + 12345
    t = hugepages.huge_empty(n)
    assert t.dtype is torch.uint8 and t.shape == (n,) and t.is_contiguous()
    t.fill_(7)
    assert int(t.sum()) == 7 * n
    assert hugepages.huge_empty(100).shape == (100,)  # below one huge page: torch.empty's


@pytest.mark.parametrize("how", ["thp", "env_off", "no_mmap", "no_madvise"])
def test_pack_rows_same_groups_with_or_without_huge_pages(monkeypatch, how):
    blocks = quant.quantize(torch.randn(O, I) * 0.02, FMT)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    if how == "env_off":
        monkeypatch.setenv("HEADWISE_HUGEPAGES", "0")
    elif how == "no_mmap":
        monkeypatch.setattr(hugepages.mmap, "mmap", _refuse)
    elif how == "no_madvise":
        monkeypatch.setattr(hugepages.mmap, "mmap", _NoMadvise)
    got = quant.pack_rows(blocks, FMT, O, I)
    assert got.shape == (O // 8, 8 * quant.row_bytes(FMT, I)) and got.is_contiguous()
    assert torch.equal(quant.unpack_rows(got, FMT, O, I), blocks)
    x = torch.randn(2, I)
    y = quant.run_quant(quant.plan_quant(got, FMT, O, I, packed=True), x)
    assert_close(y, quantized_x(x), blocks, FMT)  # against the gguf package's weights, float64
