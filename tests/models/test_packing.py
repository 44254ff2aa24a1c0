"""PackedLinear against nn.Linear: same outputs, same gradients, and a weight edit is seen."""

import pytest
import torch
from torch import nn

from headwise import kernels
from headwise.models.packing import PackedLinear, pack_linears, packing_available, prepack, unpack_linears


def test_onednn_packing_runs_here():
    assert packing_available() is None  # the CPU build of torch ships oneDNN


def _pair(bias: bool, seed: int = 0):
    """(nn.Linear, the PackedLinear pack_linears put in its place in a copy's parent)."""
    torch.manual_seed(seed)
    ref = nn.Linear(96, 200, bias=bias)
    model = nn.Sequential(nn.Linear(96, 200, bias=bias))
    model.load_state_dict({f"0.{k}": v for k, v in ref.state_dict().items()})
    plain = model[0]
    assert pack_linears(model) == 1
    packed = model[0]
    assert packed is not plain and packed.weight is plain.weight  # replaced, over the same parameters
    return ref, packed


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (3, 7, 96), (64, 96)])
def test_packed_forward_equals_linear(bias, shape):
    ref, packed = _pair(bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        want, got = ref(x), packed(x)
    rows = x.numel() // 96
    kernel = rows <= kernels.MAX_ROWS and kernels.kernels_unavailable() is None
    assert type(packed) is PackedLinear and (packed._packed is None) == kernel  # the path we meant ran
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_weight_edit_repacks():
    ref, packed = _pair(True)
    x = torch.randn(kernels.MAX_ROWS + 1, 96)  # more rows than the small-row kernel takes
    with torch.no_grad():
        packed(x)
        first = packed._packed
        for m in (ref, packed):
            m.weight.mul_(-2.0)  # in place: same storage, new version
        torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)
    assert packed._packed is not first


def test_weight_edit_reblocks_for_few_rows():
    """The small-row kernel's blocked copy follows in-place edits too."""
    ref, packed = _pair(False)
    x = torch.randn(1, 96)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)
        for m in (ref, packed):
            m.weight.add_(1.0)
        torch.testing.assert_close(packed(x), ref(x), atol=1e-4, rtol=1e-5)
    assert (packed._blocked is not None) == (kernels.kernels_unavailable() is None)


def test_gradients_use_the_plain_weight():
    ref, packed = _pair(True)
    x = torch.randn(5, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref(x).square().sum().backward()
    packed(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(packed.weight.grad, ref.weight.grad)
    assert packed._packed is None  # training never packs


def test_state_dict_and_unpack():
    ref, packed = _pair(True)
    with torch.inference_mode():
        packed(torch.randn(2, 96))
    assert set(packed.state_dict()) == {"weight", "bias"}
    model = nn.Sequential(packed)
    assert unpack_linears(model) == 1
    plain = model[0]
    assert type(plain) is nn.Linear and plain.weight is packed.weight
    torch.testing.assert_close(plain(torch.ones(1, 96)), ref(torch.ones(1, 96)))


def test_packing_keeps_ties_and_hooks():
    """The replacement shares the parameters (a tied head stays tied) and the hooks stay registered."""
    emb = nn.Embedding(200, 96)
    model = nn.ModuleDict({"embed": emb, "head": nn.Linear(96, 200, bias=False)})
    model["head"].weight = emb.weight
    seen = []
    handle = model["head"].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    assert pack_linears(model) == 1
    assert type(model["head"]) is PackedLinear and model["head"].weight is emb.weight
    with torch.inference_mode():
        model["head"](torch.randn(2, 96))
    assert seen == [(2, 200)]
    handle.remove()
    with torch.inference_mode():
        model["head"](torch.randn(2, 96))
    assert len(seen) == 1


def test_prepack_makes_the_copies_up_front():
    ref, packed = _pair(True)
    assert packed._packed is None and packed._blocked is None
    assert prepack(packed) == 1
    assert packed._packed is not None
    assert (packed._blocked is not None) == (kernels.kernels_unavailable() is None)
    first = packed._packed
    with torch.inference_mode():
        for rows in (1, 64):  # both paths, no repacking
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)
    assert packed._packed is first
