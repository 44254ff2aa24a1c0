"""The K-quant tiles' prefetch hint (kernels.cpu.quant_prefetch_nta_for, set per CPU at load): NTA or
T0 only changes where the weight lines are cached, never a bit of the result, which the gguf
package's weights check (float64)."""

import pytest
import torch

from headwise import kernels

from .test_quant_linear import assert_close, quantized_x, random_blocks, run


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q4_1"])
@pytest.mark.parametrize("M", [1, 3])
def test_prefetch_hint_changes_no_bit(fmt, M):
    mod, _ = kernels._ext()
    blocks, x = random_blocks(fmt, 40, 1024, seed=M), torch.randn(M, 1024)
    picked = mod.quant_prefetch_nta(-1)
    assert picked == kernels.cpu.quant_prefetch_nta_for()
    try:
        outs = []
        for hint in (0, 1):
            mod.quant_prefetch_nta(hint)
            outs.append(run(blocks, fmt, x, packed=True))
    finally:
        mod.quant_prefetch_nta(picked)
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], quantized_x(x), blocks, fmt)
    with pytest.raises(ValueError, match="0 .T0. or 1 .NTA."):
        mod.quant_prefetch_nta(2)


def test_prefetch_hint_by_cpu_and_environment(monkeypatch):
    monkeypatch.delenv("HEADWISE_QUANT_PREFETCH_NTA", raising=False)
    assert kernels.cpu.quant_prefetch_nta_for("AuthenticAMD", "25") == 1  # Zen 4, measured
    assert kernels.cpu.quant_prefetch_nta_for("AuthenticAMD", "26") == 0
    assert kernels.cpu.quant_prefetch_nta_for("GenuineIntel", "6") == 0
    monkeypatch.setenv("HEADWISE_QUANT_PREFETCH_NTA", "0")
    assert kernels.cpu.quant_prefetch_nta_for("AuthenticAMD", "25") == 0
    monkeypatch.setenv("HEADWISE_QUANT_PREFETCH_NTA", "2")
    with pytest.raises(ValueError, match="HEADWISE_QUANT_PREFETCH_NTA"):
        kernels.cpu.quant_prefetch_nta_for()
