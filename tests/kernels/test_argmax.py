"""kernels.argmax_rows (csrc/x86/avx2/rows.c) against torch.argmax: the first index of each row's maximum."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import kernels

VARIANTS = [v for v, flags in kernels.ISA_VARIANTS.items() if set(flags) <= kernels.cpu_flags()]  # this CPU runs


def variant_argmax(variant: str, x: torch.Tensor) -> torch.Tensor | None:
    """One compiled variant's answer (None: it reported a NaN row), called directly."""
    mod = importlib.import_module(f"headwise.kernels._cpu_{variant}")
    out = torch.full((x.shape[0],), -7, dtype=torch.long)
    nans = mod.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return None if nans else out


def test_this_machine_has_a_variant_to_test():
    assert kernels.kernels_unavailable() is None and VARIANTS


@settings(max_examples=150, deadline=None)
@given(
    R=st.integers(1, 20),
    V=st.integers(1, 70),
    levels=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    variant=st.sampled_from(VARIANTS),
)
def test_ties_and_odd_lengths_equal_torch(R, V, levels, seed, variant):
    """Few distinct values, so most rows tie: the first maximum must win, across lanes and tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (R, V), generator=g).float() - 2.0
    assert torch.equal(variant_argmax(variant, x), x.argmax(dim=-1))
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("R,V", [(16, 49152), (1, 49152), (64, 32000), (3, 8), (2, 9)])
def test_vocabulary_sized_rows_equal_torch(variant, R, V):
    x = torch.randn(R, V, generator=torch.Generator().manual_seed(R * V))
    x[0, V - 1] = x[0].max() + 1  # a maximum in the last position (the tail, or the last lane)
    assert torch.equal(variant_argmax(variant, x), x.argmax(dim=-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_infinities_equal_torch(variant):
    x = torch.full((4, 37), float("-inf"))
    x[1, 20] = float("inf")
    x[1, 30] = float("inf")
    x[2, 36] = -1e38
    x[3, :] = torch.finfo(torch.float32).max
    assert torch.equal(variant_argmax(variant, x), x.argmax(dim=-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("col", [0, 5, 8, 40, 44])
def test_a_nan_row_is_reported_and_answered_as_torch(variant, col):
    """torch.argmax returns a NaN's index; the kernel says it saw one and argmax_rows asks torch."""
    x = torch.randn(3, 45, generator=torch.Generator().manual_seed(col))
    x[1, col] = float("nan")
    assert variant_argmax(variant, x) is None
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert kernels.argmax_rows(x)[1] == col


def test_strided_rows_and_other_dtypes_equal_torch():
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    rows = wide[:, 7:250]  # rows 300 floats apart
    assert rows.stride(0) == 300
    assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))
    cols = wide.t()  # no unit stride: torch's
    assert torch.equal(kernels.argmax_rows(cols), cols.argmax(dim=-1))
    half = wide.bfloat16()
    assert torch.equal(kernels.argmax_rows(half), half.argmax(dim=-1))


def test_without_the_kernels_torch_answers(monkeypatch):
    monkeypatch.setattr(kernels, "_ext", lambda: (None, "switched off"))
    x = torch.randn(4, 100)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
