"""Captured patterns and per-head outputs against Hugging Face transformers (eager attention,
output_attentions) with the same weights: real MiniLM and a random GQA Llama."""

import pytest
import torch

import headwise
from headwise.analysis import Capture, attached, attention_layers, capture, encode, from_ids
from headwise.analysis.capture import forward

from .conftest import SENTENCES

# probabilities rebuilt from the fused kernel's LSE (its exp2 polynomial, 1 or 2 threads): 1.04e-5 seen
TOL = 2e-5


def _hf_batch(batch):
    return batch.ids, batch.mask


@torch.no_grad()
def test_minilm_patterns_match_transformers(minilm, minilm_hf):
    batch, cap = capture(minilm, SENTENCES, points=("pattern", "z", "result"))
    assert not batch.mask.all()  # padded rows: the mask is exercised
    outs = {}
    hooks = [
        layer.attention.output.dense.register_forward_hook(lambda m, i, o, l=l: outs.__setitem__(l, o))
        for l, layer in enumerate(minilm_hf.encoder.layer)
    ]
    try:
        ref = minilm_hf(batch.ids, attention_mask=batch.mask, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    valid = batch.valid
    assert len(cap.pattern) == len(ref.attentions) == 6
    for l, want in enumerate(ref.attentions):  # (B, H, T, S)
        got = cap.pattern[l]
        assert got.shape == want.shape == (3, 12, batch.ids.shape[1], batch.ids.shape[1])
        assert (got - want).abs().amax(dim=(1, 3))[valid].max() <= TOL  # padded query rows are undefined in HF
        # per-head contributions add up to the attention output (before the residual + norm)
        layer = attention_layers(minilm)[l]
        total = cap.result[l].sum(2) + layer.out_proj.bias
        assert (total - outs[l])[valid].abs().max() <= 1e-4


@pytest.mark.parametrize("backend", ["auto", "chunked", "math"])
@torch.no_grad()
def test_gqa_llama_patterns_match_transformers(tiny_llama, backend):
    hf, path = tiny_llama
    model = headwise.load(path, backend=backend)
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding on row 1
    batch = from_ids([ids[0].tolist(), ids[1, :9].tolist()])
    batch.ids[1, 9:] = ids[1, 9:]  # same ids as HF sees under the padding
    _, cap = capture(model, batch, points=("pattern", "q", "k", "v", "z"))
    ref = hf(ids, attention_mask=mask, output_attentions=True)
    for l, want in enumerate(ref.attentions):
        assert cap.q[l].shape == (2, 6, 14, 8) and cap.k[l].shape == cap.v[l].shape == (2, 2, 14, 8)
        got = cap.pattern[l]
        assert (got - want).abs().amax(dim=(1, 3))[mask.bool()].max() <= TOL
        assert got[1, :, :, 9:].abs().max() == 0  # padding is never attended


@torch.no_grad()
def test_pattern_for_chosen_heads_only(tiny_llama):
    _, path = tiny_llama
    model = headwise.load(path)
    ids = [[5, 7, 9, 11, 13, 2, 4]]
    _, every = capture(model, from_ids(ids), points=("pattern",))
    _, some = capture(model, from_ids(ids), points=("pattern", "result"), heads={0: [4, 1], 1: [2]})
    assert some.pattern[0].shape == (1, 2, 7, 7) and some.pattern[1].shape == (1, 1, 7, 7)
    assert torch.equal(some.pattern[0], every.pattern[0][:, [4, 1]])
    assert some.result[1].shape == (1, 7, 1, 48)


def test_hooks_are_removed_even_on_error(minilm):
    layers = attention_layers(minilm)
    batch = encode(minilm, "hello")
    with pytest.raises(RuntimeError, match="boom"):
        with attached(minilm, capture=Capture(("z",))):
            assert all(m.hook is not None for m in layers)
            raise RuntimeError("boom")
    assert all(m.hook is None for m in layers)
    with attached(minilm):
        with pytest.raises(RuntimeError, match="already have a hook"):
            with attached(minilm):
                pass
    assert all(m.hook is None for m in layers)
    with torch.no_grad():
        forward(minilm, batch)  # runs clean afterwards


def test_capture_rejects_bad_requests(minilm):
    with pytest.raises(ValueError, match="unknown capture points"):
        Capture(("attn",))
    with pytest.raises(ValueError, match="heads .* out of range"):
        capture(minilm, "hello", heads=[12])
    with pytest.raises(ValueError, match="mask has 2 entries but the model has 6"):
        with attached(minilm, mask=[torch.ones(12)] * 2):
            pass
    with pytest.raises(ValueError, match=r"must be \(H,\)"):
        with torch.no_grad(), attached(minilm, mask=[torch.ones(5)] * 6):
            forward(minilm, encode(minilm, "hello"))
