"""The layer under backend="auto" takes headwise's prefill kernel where it serves (fp32 CPU, causal
or no mask, no autograd, no dropout) and equals the math reference; elsewhere it falls back, and
explain() says which backend and why."""

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.attention import attend, explain
from headwise.kernels import prefill as kernel_prefill


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the prefill kernel's calls (the backend reaches it through its module)."""
    calls = []
    real = kernel_prefill.prefill_attention_unchecked

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_prefill, "prefill_attention_unchecked", counted)
    return calls


def layer_pair(H, Hkv, C=64, dropout=0.0):
    """The same weights under auto and under the math reference."""
    auto = MultiHeadAttention(C, H, Hkv, dropout=dropout)
    ref = MultiHeadAttention(C, H, Hkv, backend="math")
    ref.load_state_dict(auto.state_dict())
    return auto, ref


def heads(layer, x):
    """q, k, v as the layer hands them to attend(): views of its fused projection."""
    B, T, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = layer.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], -1)
    return (
        q.view(B, T, H, D).transpose(1, 2),
        k.view(B, T, Hkv, D).transpose(1, 2),
        v.view(B, T, Hkv, D).transpose(1, 2),
    )


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
def test_auto_takes_the_prefill_kernel_and_equals_math(H, Hkv, causal, kernel_calls):
    auto, ref = layer_pair(H, Hkv)
    x = torch.randn(2, 70, 64)  # 70 tokens: a full block of 64 and a partial one
    with torch.no_grad():
        e = explain(*heads(auto, x), is_causal=causal)
        assert e.chosen == "prefill" and "faster than PyTorch's SDPA" in str(e)
        got = auto(x, is_causal=causal)
        assert kernel_calls, "auto did not call the prefill kernel"
        want = ref(x, is_causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_right_padding_takes_the_kernel_and_equals_math(kernel_calls):
    """A batch padded at the end of its rows (an encoder's): each row against its real keys."""
    auto, ref = layer_pair(4, 2)
    x = torch.randn(3, 70, 64)
    pad = torch.zeros(3, 70, dtype=torch.bool)
    pad[1, 50:] = True  # the second row's last 20 tokens are padding
    pad[2, :] = True  # the third is all padding: zeros, as math gives
    with torch.no_grad():
        assert explain(*heads(auto, x), key_padding_mask=pad).chosen == "prefill"
        got, want = auto(x, key_padding_mask=pad), ref(x, key_padding_mask=pad)
    assert len(kernel_calls) == 3  # one per row
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "where,T,why",
    [
        ("left", 70, "key padding only at the end"),
        ("causal", 70, "key padding only at the end"),
        ("end", 16, "S >= 64"),
    ],
)
def test_other_padding_falls_back_and_equals_math(where, T, why, kernel_calls):
    """Left padding, padding with causal, and right padding of fewer than 64 keys (a call per row
    costs more than SDPA there) go to sdpa."""
    auto, ref = layer_pair(4, 2)
    x = torch.randn(2, T, 64)
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, : T // 3] = where == "left"  # left padding: the first keys of row 1
    pad[1, -T // 3 :] = where != "left"
    causal = where == "causal"
    with torch.no_grad():
        e = explain(*heads(auto, x), key_padding_mask=pad, is_causal=causal)
        assert e.chosen == "sdpa" and why in " ".join(e.rejected["prefill"])
        got, want = auto(x, key_padding_mask=pad, is_causal=causal), ref(x, key_padding_mask=pad, is_causal=causal)
    assert not kernel_calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grad_falls_back_with_the_same_gradients(kernel_calls):
    """Training: the kernel has no backward, so auto takes sdpa; its gradients equal math's."""
    auto, ref = layer_pair(4, 2)
    x = torch.randn(2, 70, 64)
    e = explain(*heads(auto, x), is_causal=True)  # the projection's outputs require grad
    assert e.chosen == "sdpa" and "no autograd" in " ".join(e.rejected["prefill"])
    auto(x, is_causal=True).square().sum().backward()
    ref(x, is_causal=True).square().sum().backward()
    assert not kernel_calls
    for (name, a), b in zip(auto.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_dropout_falls_back(kernel_calls):
    """Dropout on the weights (training mode): not in the kernel; in eval the kernel runs again."""
    auto, ref = layer_pair(4, 4, dropout=0.5)
    x = torch.randn(1, 70, 64)
    with torch.no_grad():
        e = explain(*heads(auto, x), is_causal=True, dropout_p=0.5)
        assert e.chosen == "sdpa" and "no dropout" in e.rejected["prefill"]
        train = auto.train()(x, is_causal=True)
        assert not kernel_calls
        assert not torch.allclose(train, ref.eval()(x, is_causal=True), atol=1e-3)  # weights were dropped
        torch.testing.assert_close(auto.eval()(x, is_causal=True), ref(x, is_causal=True), atol=1e-5, rtol=1e-5)
    assert kernel_calls


def test_head_concatenation_is_a_view():
    """The kernel writes tokens first: the (B, H, T, D) output transposes back to (B, T, H*D) for
    free, and equals math's values."""
    q, k, v = torch.randn(2, 70, 4, 16).transpose(1, 2), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    out = attend(q, k, v, is_causal=True, backend="prefill")
    flat = out.transpose(1, 2)
    assert flat.is_contiguous()
    torch.testing.assert_close(out, attend(q, k, v, is_causal=True, backend="math"), atol=1e-5, rtol=1e-5)
