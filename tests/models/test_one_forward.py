"""The one forward, `model(input_ids, step)`, against Hugging Face transformers for every cache kind.

The reference is always HF's plain forward over each sequence whole and alone (random weights,
saved and loaded with `headwise.load`): whatever a step does (right padding, block tables,
packing prefill chunks with decodes, recomputing a preempted sequence), row t of sequence s
must give HF's logits at position t of s, to 1e-4 in fp32. Decodes feed the sequence's own next
tokens (teacher forcing), so every position is checked, not only a greedy path. int8 K/V:
test_one_forward_int8.py; the drivers (contiguous_run, packed_schedule): stepping.py.
"""

import copy
import random

import pytest
import torch

import headwise
from headwise.cache import ContiguousKVCache, PagedKVCache, SlidingWindowCache
from headwise.models import blocks

from .conftest import V
from .stepping import assert_scattered, close, contiguous_run, hf_logits, packed_schedule, padded, scattered, tokens

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

# ---------------------------------------------------------------------------- contiguous


@pytest.mark.parametrize("route", ["few-rows", "general"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "llama-mqa-tied", "llama-bias", "qwen2", "mistral"])
@torch.inference_mode()
def test_contiguous_ragged_batch_matches_hf(decoder, few_rows, monkeypatch, name, route):
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = decoder(name)
    cfg = model.config
    seqs = [tokens(n, seed=n) for n in (20, 16, 18)]
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 32, cfg.head_dim)
    contiguous_run(model, seqs, hf_logits(hf, seqs), cache)
    if route == "few-rows":  # the decodes (3 rows) and the ragged step (9) fit ROUTE_ROWS
        assert len(few_rows) >= 5 * cfg.num_layers
    else:
        assert few_rows == []


@pytest.mark.parametrize("as_list", [False, True])
@torch.inference_mode()
def test_contiguous_logits_indices_pick_rows_of_a_ragged_prefill(decoder, as_list):
    """Flat rows b * T + t in any order, as a tensor or a list of ints (the engine's runner): each
    sequence's last real token, last sequence first."""
    hf, model = decoder("qwen2")
    cfg = model.config
    seqs = [tokens(n, seed=60 + n) for n in (11, 4, 8)]
    refs = hf_logits(hf, seqs)
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 16, cfg.head_dim)
    T, lens = 11, torch.tensor([11, 4, 8])
    rows = [2 * T + 7, 0 * T + 10, 1 * T + 3]
    out = model(padded(seqs), cache.step(T, num_new=lens, logits_indices=rows if as_list else torch.tensor(rows)))
    assert out.shape == (3, V)
    close(out, torch.stack([refs[2][7], refs[0][10], refs[1][3]]))


@pytest.mark.parametrize(
    "rows, why", [([0, 12], r"in \[0, B\*T = 12\).*\[0, 12\]"), ([-1], r"\[-1, -1\]"), ([], "non-empty")]
)
def test_logits_indices_out_of_range_are_refused_with_the_range(decoder, rows, why):
    _, model = decoder("llama-gqa")
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 8, cfg.head_dim)
    for given in (rows, torch.tensor(rows, dtype=torch.long)):
        with pytest.raises(ValueError, match=why):
            model(torch.zeros(2, 6, dtype=torch.long), cache.step(6, logits_indices=given))


@torch.inference_mode()
def test_old_keywords_build_the_same_step(decoder):
    """model(ids, cache=..., attention_mask=...) still works and is the same forward."""
    hf, model = decoder("llama-gqa")
    cfg = model.config
    seqs = [tokens(12, seed=1), tokens(7, seed=2)]
    refs = hf_logits(hf, seqs)
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim)
    mask = torch.tensor([[1] * 10, [1] * 5 + [0] * 5])
    out = model(padded([seqs[0][:10], seqs[1][:5]]), cache=cache, attention_mask=mask)
    close(out[0], refs[0][:10])
    close(out[1, :5], refs[1][:5])
    out = model(torch.tensor([[seqs[0][10]], [seqs[1][5]]]), cache=cache)
    close(out[0, 0], refs[0][10])
    close(out[1, 0], refs[1][5])


# ---------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("route", ["few-rows", "general"])
@torch.inference_mode()
def test_sliding_window_cache_matches_hf_mistral(decoder, monkeypatch, route):
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = decoder("mistral-window")  # sliding_window = 6, sequences of 16-20
    cfg = model.config
    assert cfg.sliding_window == 6
    seqs = [tokens(n, seed=10 + n) for n in (20, 16, 18)]
    refs = hf_logits(hf, seqs)
    cache = SlidingWindowCache(cfg.num_layers, 3, cfg.num_kv_heads, cfg.sliding_window, cfg.head_dim)
    contiguous_run(model, seqs, refs, cache)
    # the window matters here: the same weights attending to every earlier key differ from HF
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.config.sliding_window = None
        if hasattr(layer.self_attn, "sliding_window"):
            layer.self_attn.sliding_window = None
    assert (full(torch.tensor([seqs[0]])).logits[0, 10:] - refs[0][10:]).abs().max() > 1e-2


# ---------------------------------------------------------------------------- paged


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "qwen2"])
@torch.inference_mode()
def test_paged_batch_ragged_then_decode_matches_hf(decoder, name):
    hf, model = decoder(name)
    seqs = [tokens(n, seed=20 + n) for n in (19, 13, 22)]
    refs = hf_logits(hf, seqs)
    cache = scattered(model)
    lens = [9, 3, 12]
    for b in range(3):
        assert cache.add_sequence(b, seqs[b][: lens[b]]) == 0
    step = cache.batch([0, 1, 2], num_new=lens, token_ids=[s[:n] for s, n in zip(seqs, lens)])
    out = model(padded([s[:n] for s, n in zip(seqs, lens)]), step)
    for b, n in enumerate(lens):
        close(out[b, :n], refs[b][:n])
    pos = list(lens)
    for _ in range(5):
        new = [[s[p]] for s, p in zip(seqs, pos)]
        out = model(torch.tensor(new), cache.batch([0, 1, 2], token_ids=new))
        for b, p in enumerate(pos):
            close(out[b, 0], refs[b][p])
        pos = [p + 1 for p in pos]
    chunk = [s[p : p + k] for s, p, k in zip(seqs, pos, (4, 2, 3))]  # a padded ragged chunk, T = 4
    rows = torch.tensor([1 * 4 + 1, 2 * 4 + 2, 0 * 4 + 3])  # each one's last real row, b * T + t
    out = model(padded(chunk), cache.batch([0, 1, 2], [4, 2, 3], chunk, logits_indices=rows))
    assert out.shape == (3, V)
    close(out, torch.stack([refs[1][pos[1] + 1], refs[2][pos[2] + 2], refs[0][pos[0] + 3]]))
    assert_scattered(cache, [0, 1, 2])


@pytest.mark.parametrize(
    "seed, route", [(0, "few-rows"), (1, "few-rows"), (2, "few-rows"), (3, "few-rows"), (0, "general"), (1, "general")]
)
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "mistral"])
@torch.inference_mode()
def test_paged_packed_mixed_steps_match_hf(decoder, few_rows, monkeypatch, name, seed, route):
    """Chunked prefill at random split points, packed with other sequences' decodes; on about
    half the steps `logits_indices` asks for each sequence's last row only."""
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = decoder(name)
    rng = random.Random(seed)
    lengths = {s: rng.randint(6, 26) for s in "abcd"}
    seqs = {s: tokens(n, seed=100 * seed + i) for i, (s, n) in enumerate(lengths.items())}
    prompts = {s: rng.randint(2, n - 2) for s, n in lengths.items()}
    refs = dict(zip(seqs, hf_logits(hf, list(seqs.values()))))
    cache = scattered(model)
    start_at = {s: rng.randint(0, 3) for s in seqs}
    checked, mixed = 0, 0
    for out, where, counts in packed_schedule(cache, model, seqs, prompts, rng, start_at):
        want = torch.stack([refs[s][p] for s, p in where])
        close(out, want)
        checked += len(where)
        mixed += min(counts) == 1 < max(counts)  # a prefill chunk packed with a decode
    assert checked >= sum(n - prompts[s] for s, n in lengths.items())  # every decode at least
    assert_scattered(cache, list(seqs))
    assert mixed >= 3 and (len(few_rows) > 0) == (route == "few-rows")


@pytest.mark.parametrize("prefix_survives", [True, False])
@torch.inference_mode()
def test_preempted_sequence_recomputed_matches_hf(decoder, prefix_survives):
    """A sequence freed mid-decode (preempted) and recomputed from prompt + generated tokens,
    reusing its full blocks from the prefix table when they survive, gives HF's next logits."""
    hf, model = decoder("llama-gqa")
    seq, other = tokens(24, seed=31), tokens(20, seed=32)
    ref, ref_other = hf_logits(hf, [seq, other])
    cfg, bs = model.config, 4
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 24, bs)
    cache.add_sequence("a", seq[:10])
    cache.add_sequence("b", other[:6])
    out = model(torch.tensor([seq[:10] + other[:6]]), cache.packed(["a", "b"], [10, 6], [seq[:10], other[:6]]))
    close(out[0, :10], ref[:10])
    close(out[0, 10:], ref_other[:6])
    for p in range(4):  # a and b decode side by side
        out = model(
            torch.tensor([[seq[10 + p], other[6 + p]]]),
            cache.packed(["a", "b"], [1, 1], [[seq[10 + p]], [other[6 + p]]]),
        )
        close(out[0, 0], ref[10 + p])
        close(out[0, 1], ref_other[6 + p])
    cache.free("a")  # preempted with 14 tokens: 3 full blocks
    if not prefix_survives:  # another sequence takes every free block
        cache.add_sequence("hog")
        cache.batch(["hog"], num_new=cache.num_free_blocks * bs)
        cache.free("hog")
    n = cache.add_sequence("a", seq[:14])
    assert n == (12 if prefix_survives else 0)
    last = torch.tensor([14 - n - 1, 14 - n])  # a's last recomputed row, then b's decode
    out = model(
        torch.tensor([seq[n:14] + [other[10]]]),
        cache.packed(["a", "b"], [14 - n, 1], [seq[n:14], [other[10]]], logits_indices=last),
    )
    close(out[0], ref[13])
    close(out[1], ref_other[10])
    for p in range(14, 18):
        out = model(torch.tensor([[seq[p]]]), cache.packed(["a"], [1], [[seq[p]]]))
        close(out[0, 0], ref[p])


# ---------------------------------------------------------------------------- pruned, uneven GQA groups


@torch.inference_mode()
def test_pruned_uneven_gqa_groups_match_hf_with_those_heads_silenced(decoder):
    """prune_heads leaves groups of 2 and 3 (layer 0) and 3 and 4 (layer 1) query heads per KV
    head (kv_map). HF has no GQA pruning; a removed query head contributes nothing, which in HF
    is its o_proj input columns set to zero."""
    from headwise.analysis.prune import prune_heads

    hf, _ = decoder("llama-gqa")
    model = headwise.load(decoder.path("llama-gqa"))  # its own copy: pruning is in place
    plan = {0: [0, 1, 5], 1: [2]}
    prune_heads(model, plan)
    assert all(model.layers[i].attn.kv_map is not None for i in (0, 1))
    ref_model, D = copy.deepcopy(hf), model.config.head_dim
    for layer, heads in plan.items():
        for h in heads:
            ref_model.model.layers[layer].self_attn.o_proj.weight[:, h * D : (h + 1) * D] = 0
    seqs = [tokens(n, seed=50 + n) for n in (20, 16, 18)]
    refs = hf_logits(ref_model, seqs)
    assert (refs[0] - hf_logits(hf, seqs[:1])[0]).abs().max() > 1e-2  # the pruning changes the logits
    close(model(torch.tensor([seqs[0]])), refs[0][None])  # no cache
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 32, cfg.head_dim)
    contiguous_run(model, seqs, refs, cache)
    named = dict(zip("abc", seqs))
    for out, where, _ in packed_schedule(
        scattered(model), model, named, {s: 7 for s in named}, random.Random(3), {"a": 0, "b": 1, "c": 2}
    ):
        close(out, torch.stack([refs["abc".index(s)][p] for s, p in where]))
