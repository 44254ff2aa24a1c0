"""Slices of a linear (parallel/layers.py) and the legal world sizes (parallel/shard.py), in
one process: a slice's output against the whole linear's, and the split errors' wording."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from headwise.core.config import ModelConfig
from headwise.models import GPT2, Llama
from headwise.models.linear import FORMATS, QuantizedLinear
from headwise.models.packing import PackedLinear
from headwise.parallel import check_world_size, legal_world_sizes
from headwise.parallel.layers import take_columns, take_rows


def quantized(fmt: str, O: int, I: int, packed: bool) -> QuantizedLinear:
    w = torch.randn(O, I, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(FORMATS[fmt][0])))
    lin = QuantizedLinear(I, O, fmt, blocks=blocks)
    if packed:
        lin.pack()
    return lin


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@torch.inference_mode()
def test_quantized_slices_keep_blocks_and_compute_the_whole(fmt, packed):
    O, I = 40, 192  # 6 blocks of 32 per row
    lin = quantized(fmt, O, I, packed)
    x = torch.randn(3, I, generator=torch.Generator().manual_seed(1))
    whole = lin(x)  # (3, O)
    rows = torch.tensor([1, 2, 3, 17, 18, 39])
    part = take_rows(lin, rows)
    assert type(part) is QuantizedLinear and part.packed == lin.packed and part.fmt == fmt
    torch.testing.assert_close(part(x), whole[:, rows], rtol=0, atol=1e-6)  # rows are independent
    # input columns on block boundaries: per-slice products sum to the whole (activations are
    # rounded per 32 values, the same blocks in the slices as in the whole)
    total = torch.zeros_like(whole)
    for lo, hi in [(0, 64), (64, 160), (160, 192)]:
        cols, dequantized = take_columns(lin, lo, hi)
        assert not dequantized and type(cols) is QuantizedLinear and cols.in_features == hi - lo
        total += cols(x[:, lo:hi])
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_slice_through_blocks_is_dequantized_to_the_same_weights():
    lin = quantized("q8_0", 8, 64, packed=False)
    cols, dequantized = take_columns(lin, 0, 40)  # 40 is not a multiple of 32
    assert dequantized and cols.weight.dtype == torch.float32
    torch.testing.assert_close(cols.weight, lin.weight[:, :40], rtol=0, atol=0)


@torch.inference_mode()
def test_dense_slices_keep_their_class():
    lin = torch.nn.Linear(16, 12)
    lin.__class__ = PackedLinear
    x = torch.randn(5, 16)
    rows = torch.arange(4, 9)
    part = take_rows(lin, rows)
    assert type(part) is PackedLinear
    torch.testing.assert_close(part(x), F.linear(x, lin.weight, lin.bias)[:, rows])
    cols, _ = take_columns(lin, 6, 16)
    assert type(cols) is PackedLinear and cols.bias is None
    torch.testing.assert_close(cols(x[:, 6:]), F.linear(x[:, 6:], lin.weight[:, 6:]))


def test_world_sizes_are_the_divisors_of_the_kv_heads():
    common = dict(vocab_size=32, num_layers=1, d_ff=32, max_positions=16)
    mha = GPT2(ModelConfig(name="g", arch="gpt2", d_model=48, num_heads=12, **common))
    assert legal_world_sizes(mha) == [1, 2, 3, 4, 6, 12]  # MHA: every head is its own group
    with pytest.raises(ValueError) as e:
        check_world_size(mha, 5)
    assert "cannot split 12 KV heads over 5 ranks" in str(e.value) and "1, 2, 3, 4, 6, 12" in str(e.value)
    llama = dict(arch="llama", mlp="swiglu", norm="rmsnorm", positions="rope")
    gqa = Llama(ModelConfig(name="l", d_model=72, num_heads=9, num_kv_heads=3, **llama, **common))
    assert legal_world_sizes(gqa) == [1, 3]
    with pytest.raises(ValueError, match="cannot split 3 KV heads over 2 ranks.*sizes for this model: 1, 3"):
        check_world_size(gqa, 2)
