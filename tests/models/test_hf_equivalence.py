"""headwise models against Hugging Face transformers with the same (random) weights.

Each HF model is built offline from a tiny config, saved with save_pretrained, and
loaded back with `headwise.load(dir)`; outputs must agree to 1e-4 in fp32.
"""

import pytest
import torch

import headwise

from .conftest import LLAMA, V, decoder_configs, hf_checkpoints

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

TOL = 1e-4
_SHARED = decoder_configs()  # gpt2, llama-*, qwen2, mistral (also with a window shorter than the inputs)


def _llama(**kw):
    return tf.LlamaConfig(**{**LLAMA, **kw}), tf.LlamaForCausalLM


DECODERS = {
    **_SHARED,
    "llama-rope-linear": lambda: _llama(num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # dynamic NTK only changes anything past max_position_embeddings: inputs here are longer
    "llama-rope-dynamic": lambda: _llama(
        num_key_value_heads=2, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
    # D = 8: wavelengths 6.3 (kept), 63 (smoothed), 628 and 6283 (divided by factor) around 64/4..64/1
    "llama-rope-llama3": lambda: _llama(
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
CACHED = [n for n in DECODERS if n != "llama-rope-dynamic"]  # dynamic NTK re-scales old keys only on re-forward


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, checkpoint dir), built once per module."""
    return hf_checkpoints(tmp_path_factory, DECODERS, seed=1234)


def _ids(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(DECODERS))
@torch.no_grad()
def test_decoder_logits_match_hf(saved, name):
    hf, path = saved(name)
    model = headwise.load(path)
    ids = _ids(2, 24 if "dynamic" in name else 20)
    got, want = model(ids), hf(ids).logits
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, ids.shape[1], V)
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "qwen2"])
@torch.no_grad()
def test_left_padding_mask_matches_hf(saved, name):
    hf, path = saved(name)
    model = headwise.load(path)
    ids = _ids(2, 12, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 is left-padded
    got, want = model(ids, attention_mask=mask), hf(ids, attention_mask=mask).logits
    real = mask.bool()  # padded query rows are undefined in HF
    assert (got[real] - want[real]).abs().max() <= TOL
    assert torch.isfinite(got).all()  # a padded row that sees no key gives no NaN


def _greedy(model, ids, n):
    """The simplest decoder: full re-forward each step, argmax of the last position."""
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "llama-mqa-tied", "llama-rope-llama3", "qwen2"])
@torch.no_grad()
def test_greedy_generation_matches_hf(saved, name):
    hf, path = saved(name)
    model = headwise.load(path)
    prompt = _ids(1, 8, seed=2)
    want = hf.generate(prompt, do_sample=False, max_new_tokens=32, attention_mask=torch.ones_like(prompt))
    got = _greedy(model, prompt, 32)
    assert want.shape == (1, 40)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("name", CACHED)
@torch.no_grad()
def test_cached_decode_matches_full_forward(saved, name):
    from headwise.cache import ContiguousKVCache

    _, path = saved(name)
    model = headwise.load(path)
    cfg = model.config
    ids = _ids(2, 16, seed=3)
    full = model(ids)
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 32, cfg.head_dim)
    steps = [model(ids[:, :6], cache=cache)]  # prefill 6
    steps += [model(ids[:, t : t + 1], cache=cache) for t in range(6, 16)]  # then one token at a time
    assert (torch.cat(steps, dim=1) - full).abs().max() <= TOL


@torch.no_grad()
def test_ragged_cached_decode_matches_each_row_alone(saved):
    """Right-padded prefill of two prompts of different lengths, then decode: each row's
    logits equal a full forward of that row alone (positions follow each row's length)."""
    from headwise.cache import ContiguousKVCache

    _, path = saved("llama-gqa")
    model = headwise.load(path)
    cfg = model.config
    rows = [_ids(1, 12, seed=4)[0], _ids(1, 7, seed=5)[0]]
    prompt = torch.zeros(2, 8, dtype=torch.long)
    prompt[0], prompt[1, :7] = rows[0][:8], rows[1]
    mask = torch.tensor([[1] * 8, [1] * 7 + [0]])
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 32, cfg.head_dim)
    first = model(prompt, cache=cache, attention_mask=mask)
    assert (first[0] - model(rows[0][None, :8])[0]).abs().max() <= TOL
    assert (first[1, :7] - model(rows[1][None])[0]).abs().max() <= TOL
    nxt = torch.stack([rows[0][8], torch.tensor(3)])[:, None]  # each row's next token
    step = model(nxt, cache=cache)[:, 0]  # row 0 at position 8, row 1 at 7
    want0 = model(rows[0][None, :9])[0, -1]
    want1 = model(torch.cat([rows[1], torch.tensor([3])])[None])[0, -1]
    assert (step[0] - want0).abs().max() <= TOL and (step[1] - want1).abs().max() <= TOL


# ---------------------------------------------------------------------------- BERT


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    torch.manual_seed(99)
    config = tf.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=V,
        max_position_embeddings=32,
        type_vocab_size=2,
    )
    hf = tf.BertModel(config).eval()
    path = tmp_path_factory.mktemp("bert")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@torch.no_grad()
def test_bert_hidden_states_and_pooling_match_hf(bert):
    hf, path = bert
    model = headwise.load(path)
    ids = _ids(3, 14, seed=6)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    got = model(ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    assert (got[real] - want.last_hidden_state[real]).abs().max() <= TOL
    assert (model.pool(got, mask, "pooler") - want.pooler_output).abs().max() <= TOL
    assert (model.pool(got, mask, "cls") - want.last_hidden_state[:, 0]).abs().max() <= TOL
    # sentence-transformers' mean pooling, written out from HF's hidden states
    m = mask[..., None].float()
    mean = (want.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)
    assert (model.pool(got, mask, "mean") - mean).abs().max() <= TOL
    unit = model.pool(got, mask, "mean", normalize=True)
    assert (unit - torch.nn.functional.normalize(mean, dim=-1)).abs().max() <= TOL
    # no token_type_ids = all segment A
    assert (model(ids, mask) - hf(input_ids=ids, attention_mask=mask).last_hidden_state)[real].abs().max() <= TOL


@torch.no_grad()
def test_real_minilm_matches_hf():
    """all-MiniLM-L6-v2's real weights (package installed by `make test`)."""
    from headwise.models.builtin import resolve

    path = resolve("all-minilm-l6-v2")
    model = headwise.load(path)
    hf = tf.BertModel.from_pretrained(path).eval()
    ids = _ids(2, 16, seed=7) + 1000
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    got, want = model(ids, mask), hf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (got - want)[mask.bool()].abs().max() <= TOL
