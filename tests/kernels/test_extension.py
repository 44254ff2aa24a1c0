"""The compiled kernels: built by `pip install` (setup.py), the ISA variant picked at run time."""

import os
import subprocess
import sys

import pytest

from headwise import kernels

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


@pytest.mark.parametrize(
    "flags,want",
    [(AVX512, "avx512"), (AVX2, "avx2"), (AVX512 - {"avx512_vnni"}, "avx2"), (AVX2 - {"f16c"}, None), (set(), None)],
)
def test_the_variant_follows_the_cpu_flags(flags, want, monkeypatch):
    monkeypatch.delenv("HEADWISE_ISA", raising=False)
    isa, why = kernels.pick_isa(flags)
    assert isa == want
    assert (why is None) == (want is not None)
    if want is None:
        assert "AVX2" in why


def test_forcing_a_variant_the_cpu_lacks_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("HEADWISE_ISA", "avx512")
    isa, why = kernels.pick_isa(AVX2)
    assert isa is None and "avx512f" in why and "avx512_vnni" in why
    monkeypatch.setenv("HEADWISE_ISA", "sse9")
    isa, why = kernels.pick_isa(AVX512)
    assert isa is None and "sse9" in why and "avx2" in why


def test_this_machine_runs_the_variant_its_flags_allow():
    """Both variants are built by the install; the one for this CPU's flags is the one loaded."""
    want, _ = kernels.pick_isa()
    assert want is not None  # every machine this project runs on has AVX2 + FMA + F16C
    assert kernels.kernels_unavailable() is None
    assert kernels.isa() == want
    assert kernels._ext()[0].__name__ == f"headwise.kernels._cpu_{want}"
    for isa in kernels.ISA_VARIANTS:  # built at install (setup.py), whatever this CPU runs
        assert any(p.startswith(f"_cpu_{isa}.") for p in os.listdir(os.path.dirname(kernels.__file__)))


def test_forced_avx2_runs_and_agrees():
    """HEADWISE_ISA=avx2 in a fresh process: that variant loads and passes its self-check."""
    code = "from headwise import kernels; print(kernels.isa(), kernels.kernels_unavailable())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "HEADWISE_ISA": "avx2"}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2", "None"]


def test_bad_arguments_raise_not_crash():
    """The module's entry points check their argument count and types (the Python callers check shapes)."""
    mod = kernels._ext()[0]
    with pytest.raises(TypeError, match="15 arguments"):
        mod.small_linear(1, 2, 3)
    with pytest.raises(TypeError):
        mod.small_linear(*(["x"] * 15))
