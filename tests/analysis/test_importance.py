"""Head importance against finite differences; ablation by mask against real pruning."""

import pytest
import torch

import headwise
from headwise.analysis import Capture, attached, attention_layers, encode, from_ids, head_importance, prune_heads
from headwise.analysis.ablation import Curves, masks_for, mean_outputs, take
from headwise.analysis.capture import forward
from headwise.analysis.importance import loss_with_gates
from headwise.analysis.metrics import embeddings
from headwise.analysis.prune import plan_from

from .conftest import SENTENCES


def _finite_difference(model, batch, target=None, eps=1e-3):
    """E_b |dL_b/dxi_lh| by central differences, one gate at a time."""
    hpl = [m.num_heads for m in attention_layers(model)]
    out = []
    with torch.no_grad():
        for l, H in enumerate(hpl):
            row = []
            for h in range(H):
                diffs = []
                for sign in (1, -1):
                    gates = [torch.ones(n, dtype=torch.float64) for n in hpl]
                    gates[l][h] += sign * eps
                    diffs.append(loss_with_gates(model, batch, gates, target))
                row.append(((diffs[0] - diffs[1]) / (2 * eps)).abs().mean())
            out.append(torch.stack(row).float())
    return out


def test_importance_matches_finite_differences_decoder(tiny_llama):
    _, path = tiny_llama
    model = headwise.load(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    batch = from_ids([torch.randint(0, 96, (n,), generator=g).tolist() for n in (12, 9, 12)])  # padded row
    imp = head_importance(model, [batch])
    want = _finite_difference(model, batch)
    assert imp.examples == 3
    for got, ref in zip(imp.raw, want):
        assert torch.allclose(got, ref, rtol=2e-3, atol=1e-5), (got, ref)


def test_importance_matches_finite_differences_encoder(tiny_bert_dir):
    model = headwise.load(tiny_bert_dir, dtype=torch.float64)
    batch = encode(model, SENTENCES)
    imp = head_importance(model, [batch])
    with torch.no_grad():
        target = embeddings(model, batch)
    want = _finite_difference(model, batch, target)
    for got, ref in zip(imp.raw, want):
        assert torch.allclose(got, ref, rtol=2e-3, atol=1e-5), (got, ref)
    assert all((r > 0).all() for r in imp.raw)  # the retrieval loss has a gradient at xi = 1


@torch.no_grad()
def test_mask_ablation_equals_physical_pruning_gqa(tiny_llama):
    _, path = tiny_llama
    model = headwise.load(path)
    batch = from_ids([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 8]])
    # layer 0: all of KV group 0 (heads 0-2) and head 4; layer 1: two heads of group 0 (uneven: 1 + 3)
    removed = {(0, 0), (0, 1), (0, 2), (0, 4), (1, 1), (1, 2)}
    with attached(model, mask=masks_for(removed, [6, 6])):
        masked = forward(model, batch)
    pruned = prune_heads(model, plan_from(removed, model))
    layers = attention_layers(pruned)
    assert (layers[0].num_heads, layers[0].num_kv_heads) == (2, 1)  # KV head 0 went with its group
    assert (layers[1].num_heads, layers[1].num_kv_heads) == (4, 2) and layers[1].kv_map is not None
    got = forward(pruned, batch)
    assert (got - masked)[batch.valid].abs().max() <= 1e-5


@torch.no_grad()
def test_mask_ablation_equals_pruning_on_minilm(minilm):
    from headwise.analysis.prune import clone

    model = clone(minilm)
    batch = encode(model, SENTENCES)
    removed = {(0, 3), (2, 0), (2, 11), (5, 6), (5, 7)}
    with attached(model, mask=masks_for(removed, [12] * 6)):
        masked = embeddings(model, batch)
    got = embeddings(prune_heads(model, plan_from(removed, model)), batch)
    assert (got - masked).abs().max() <= 1e-5
    assert not torch.allclose(got, embeddings(minilm, batch), atol=1e-3)  # it did change the model


@torch.no_grad()
def test_mean_ablation_adds_the_mean_through_w_o():
    torch.manual_seed(0)
    layer = headwise.MultiHeadAttention(16, 4, bias=True)
    x = torch.randn(2, 5, 16)
    mean = torch.randn(4, 4)
    zero, rep = [torch.tensor([1.0, 0.0, 1.0, 1.0])], [mean]
    with attached(layer, mask=zero):
        y_zero = layer(x)
    with attached(layer, mask=zero, replace=rep):
        y_mean = layer(x)
    w_o = layer.out_proj.weight  # (C, H*D)
    assert torch.allclose(y_mean, y_zero + w_o[:, 4:8] @ mean[1], atol=1e-6)
    cap = Capture(("z",))
    with attached(layer, capture=cap):
        layer(x)

    class Wrap(torch.nn.Module):  # mean_outputs on a "model"
        def __init__(self):
            super().__init__()
            self.attn = layer

        def forward(self, ids, attention_mask=None):
            return self.attn(x[: ids.shape[0], : ids.shape[1]])

    means = mean_outputs(Wrap(), [from_ids([[0] * 5, [0] * 5])])
    assert torch.allclose(means[0], cap.z[0].mean(dim=(0, 2)), atol=1e-6)


def test_removal_orders_keep_a_head_per_layer_and_thresholds():
    order = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert take(order, 4, [3, 2]) == {(0, 0), (0, 1), (1, 0)}  # (0, 2) would empty layer 0
    cv = Curves(
        [0.1, 0.2, 0.3],
        {},
        "m",
        "u",
        {
            "a": [
                {"drop": 0.001, "fraction_removed": 0.1},
                {"drop": 0.02, "fraction_removed": 0.2},
                {"drop": 0.004, "fraction_removed": 0.3},
            ]
        },
    )
    assert cv.removable("a", 0.01) == 0.1  # not 0.3: the drop crossed at 0.2
    assert cv.removable("a", 0.05) == 0.3
    with pytest.raises(ValueError, match="mask has"):
        with attached(torch.nn.Sequential(headwise.MultiHeadAttention(8, 2)), mask=[]):
            pass
