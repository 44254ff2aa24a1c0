"""attached(...) checks its per-layer arguments before it touches the model."""

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise.analysis import attached


@pytest.fixture
def five_layers():
    # five attention layers, so a five-letter string has the right len() and used to get through
    return nn.ModuleList(MultiHeadAttention(16, 2) for _ in range(5))


@pytest.mark.parametrize("bad", ["means", b"means", {0: torch.zeros(2, 8)}, 3.0])
def test_replace_must_be_a_list_per_layer(five_layers, bad):
    with pytest.raises(
        TypeError,
        match=r"replace must be a list with one entry per attention layer \(5 here\)"
        r".*mean_outputs",
    ):
        with attached(five_layers, mask=[torch.zeros(2)] * 5, replace=bad):
            pass
    assert all(layer.hook is None for layer in five_layers)


def test_mask_must_be_a_list_per_layer(five_layers):
    with pytest.raises(TypeError, match=r"mask must be a list .*\(H,\) or \(B, H\) multiplier"):
        with attached(five_layers, mask="zeros"):
            pass


def test_entries_must_be_tensors(five_layers):
    with pytest.raises(TypeError, match=r"replace entries must be .* entries \[1, 3\] are \['str'\]"):
        with attached(five_layers, mask=[torch.zeros(2)] * 5, replace=[None, "m", None, "m", None]):
            pass


def test_a_valid_replace_is_what_the_head_outputs(five_layers):
    # mean ablation of every head of layer 0: z' = replace, so the layer's output is out_proj(replace)
    layer = five_layers[0]
    x, r = torch.randn(1, 3, 16), torch.randn(2, 8)
    with torch.no_grad(), attached(five_layers, mask=[torch.zeros(2)] + [None] * 4, replace=[r] + [None] * 4):
        y = layer(x)
    ref = nn.functional.linear(r.reshape(1, 16), layer.out_proj.weight, layer.out_proj.bias)  # heads in order
    assert torch.allclose(y, ref.expand(1, 3, 16), atol=1e-5)
