"""The one forward, `model(input_ids, step)`, against Hugging Face transformers for every cache kind.

The reference is always HF's plain forward over each sequence whole and alone (random weights,
saved and loaded with `headwise.load`): whatever a step does (right padding, block tables,
packing prefill chunks with decodes, recomputing a preempted sequence), row t of sequence s
must give HF's logits at position t of s, to 1e-4 in fp32. Decodes feed the sequence's own next
tokens (teacher forcing), so every position is checked, not only a greedy path.
"""
import copy
import random
import warnings

import pytest
import torch

import headwise
from headwise.cache import ContiguousKVCache, PagedKVCache, SlidingWindowCache
from headwise.models import blocks

from .conftest import V, decoder_configs, hf_checkpoints

import transformers as tf  # noqa: E402  (the independent reference)
tf.logging.set_verbosity_error()

TOL = 1e-4
# int8 K/V: values rounded to 1/127 of each (token, head) row's max |x|. Measured against HF on
# these tiny random models, the logits move by up to 1.0% of the rows' max |logit| for llama-gqa
# (2.6e-2 absolute on logits up to 3.3) and 2.5% for gpt2 (1.6e-1 on logits up to 9.7: its
# initializer_range=0.3 gives peaked attention, which amplifies key rounding). A relative bound,
# as the two models' logit scales differ 3x; 5% leaves 2x margin over the worst case measured.
INT8_REL = 5e-2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, headwise model loaded from HF's checkpoint), built once per module."""
    get = hf_checkpoints(tmp_path_factory, decoder_configs(), seed=1234)
    models = {}

    def load(name):
        if name not in models:
            hf, path = get(name)
            with warnings.catch_warnings():          # mistral-window: "sliding_window ... not applied"
                warnings.simplefilter("ignore")        # without a window cache; the test gives it one
                models[name] = hf, headwise.load(path)
        return models[name]
    load.path = lambda name: get(name)[1]
    return load


@pytest.fixture
def few_rows(monkeypatch):
    """Counts the block calls that took the few-rows route (`DecoderBlock._few_rows`)."""
    calls = []
    real = blocks.DecoderBlock._few_rows

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(blocks.DecoderBlock, "_few_rows", spy)
    return calls


def _tokens(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf(hf, seqs):
    """HF's logits over each whole sequence alone: list of (len, V)."""
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def _padded(rows):
    """Right-padded (B, T) input ids of token lists (padding id 0: it must not matter)."""
    T = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (T - len(r)) for r in rows])


def _close(got, want, tol=TOL, rel=None):
    """max |got - want| <= tol (or <= rel * max |want|); returns the error."""
    err = (got - want).abs().max().item()
    if rel is not None:
        tol = rel * want.abs().max().item()
    assert got.shape == want.shape and err <= tol, f"max |diff| {err:.2e} > {tol:.1e}"
    return err


# ---------------------------------------------------------------------------- contiguous


def _contiguous_run(model, seqs, refs, cache, **tol):
    """Ragged prefill (right-padded), a ragged multi-token step, decodes with rows at different
    lengths, and a decode asking for two rows' logits only; each against refs. Returns max error."""
    B, errs = len(seqs), []
    lens = [len(seqs[0]) // 2, 3, len(seqs[2]) // 3][:B]
    out = model(_padded([s[:n] for s, n in zip(seqs, lens)]), cache.step(max(lens), num_new=torch.tensor(lens)))
    errs += [_close(out[b, :n], refs[b][:n], **tol) for b, n in enumerate(lens)]
    new = [3, 1, 2][:B]                                                  # rows of one step, real counts differ
    out = model(_padded([s[n:n + k] for s, n, k in zip(seqs, lens, new)]), cache.step(3, num_new=torch.tensor(new)))
    errs += [_close(out[b, :k], refs[b][n:n + k], **tol) for b, (n, k) in enumerate(zip(lens, new))]
    pos = [n + k for n, k in zip(lens, new)]
    for _ in range(4):                                                   # decodes: every row at its own length
        out = model(torch.tensor([[s[p]] for s, p in zip(seqs, pos)]), cache.step(1))
        errs += [_close(out[b, 0], refs[b][p], **tol) for b, p in enumerate(pos)]
        pos = [p + 1 for p in pos]
    want = torch.tensor([B - 1, 0])                                      # flat rows b * T + t, T = 1
    out = model(torch.tensor([[s[p]] for s, p in zip(seqs, pos)]), cache.step(1, logits_indices=want))
    assert out.shape == (2, V) and out.dtype == torch.float32
    errs += [_close(out[0], refs[B - 1][pos[B - 1]], **tol), _close(out[1], refs[0][pos[0]], **tol)]
    return max(errs)


@pytest.mark.parametrize("route", ["few-rows", "general"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "llama-mqa-tied", "llama-bias", "qwen2", "mistral"])
@torch.inference_mode()
def test_contiguous_ragged_batch_matches_hf(saved, few_rows, monkeypatch, name, route):
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = saved(name)
    cfg = model.config
    seqs = [_tokens(n, seed=n) for n in (20, 16, 18)]
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 32, cfg.head_dim)
    _contiguous_run(model, seqs, _hf(hf, seqs), cache)
    if route == "few-rows":     # the decodes (3 rows) and the ragged step (9) fit ROUTE_ROWS
        assert len(few_rows) >= 5 * cfg.num_layers
    else:
        assert few_rows == []


@torch.inference_mode()
def test_contiguous_logits_indices_pick_rows_of_a_ragged_prefill(saved):
    """Flat rows b * T + t in any order: each sequence's last real token, last sequence first."""
    hf, model = saved("qwen2")
    cfg = model.config
    seqs = [_tokens(n, seed=60 + n) for n in (11, 4, 8)]
    refs = _hf(hf, seqs)
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 16, cfg.head_dim)
    T, lens = 11, torch.tensor([11, 4, 8])
    rows = torch.tensor([2 * T + 7, 0 * T + 10, 1 * T + 3])
    out = model(_padded(seqs), cache.step(T, num_new=lens, logits_indices=rows))
    assert out.shape == (3, V)
    _close(out, torch.stack([refs[2][7], refs[0][10], refs[1][3]]))


@torch.inference_mode()
def test_old_keywords_build_the_same_step(saved):
    """model(ids, cache=..., attention_mask=...) still works and is the same forward."""
    hf, model = saved("llama-gqa")
    cfg = model.config
    seqs = [_tokens(12, seed=1), _tokens(7, seed=2)]
    refs = _hf(hf, seqs)
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim)
    mask = torch.tensor([[1] * 10, [1] * 5 + [0] * 5])
    out = model(_padded([seqs[0][:10], seqs[1][:5]]), cache=cache, attention_mask=mask)
    _close(out[0], refs[0][:10]), _close(out[1, :5], refs[1][:5])
    out = model(torch.tensor([[seqs[0][10]], [seqs[1][5]]]), cache=cache)
    _close(out[0, 0], refs[0][10]), _close(out[1, 0], refs[1][5])


# ---------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("route", ["few-rows", "general"])
@torch.inference_mode()
def test_sliding_window_cache_matches_hf_mistral(saved, monkeypatch, route):
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = saved("mistral-window")                  # sliding_window = 6, sequences of 16-20
    cfg = model.config
    assert cfg.sliding_window == 6
    seqs = [_tokens(n, seed=10 + n) for n in (20, 16, 18)]
    refs = _hf(hf, seqs)
    cache = SlidingWindowCache(cfg.num_layers, 3, cfg.num_kv_heads, cfg.sliding_window, cfg.head_dim)
    _contiguous_run(model, seqs, refs, cache)
    # the window matters here: the same weights attending to every earlier key differ from HF
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.config.sliding_window = None
        if hasattr(layer.self_attn, "sliding_window"):
            layer.self_attn.sliding_window = None
    assert (full(torch.tensor([seqs[0]])).logits[0, 10:] - refs[0][10:]).abs().max() > 1e-2


# ---------------------------------------------------------------------------- paged


def _scattered(model, num_blocks=96, block_size=4, **kw):
    """A paged cache whose free blocks are every other one: the other half is held by idle
    sequences, so the tables the test's sequences get are not consecutive."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, **kw)
    for i in range(num_blocks):
        cache.add_sequence(("hold", i))
        cache.batch([("hold", i)], num_new=block_size)   # reserves a block; never run, never read
    for i in range(0, num_blocks, 2):
        cache.free(("hold", i))
    return cache


def _assert_scattered(cache, seq_ids):
    tables = [cache.block_table(s) for s in seq_ids]
    assert any(t[i + 1] != t[i] + 1 for t in tables for i in range(len(t) - 1)), tables


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "qwen2"])
@torch.inference_mode()
def test_paged_batch_ragged_then_decode_matches_hf(saved, name):
    hf, model = saved(name)
    seqs = [_tokens(n, seed=20 + n) for n in (19, 13, 22)]
    refs = _hf(hf, seqs)
    cache = _scattered(model)
    lens = [9, 3, 12]
    for b in range(3):
        assert cache.add_sequence(b, seqs[b][:lens[b]]) == 0
    step = cache.batch([0, 1, 2], num_new=lens, token_ids=[s[:n] for s, n in zip(seqs, lens)])
    out = model(_padded([s[:n] for s, n in zip(seqs, lens)]), step)
    for b, n in enumerate(lens):
        _close(out[b, :n], refs[b][:n])
    pos = list(lens)
    for _ in range(5):
        new = [[s[p]] for s, p in zip(seqs, pos)]
        out = model(torch.tensor(new), cache.batch([0, 1, 2], token_ids=new))
        for b, p in enumerate(pos):
            _close(out[b, 0], refs[b][p])
        pos = [p + 1 for p in pos]
    _assert_scattered(cache, [0, 1, 2])


def _chunks(rng, n):
    """Cut n prompt tokens into 1-4 chunks at random points: a list of (start, stop)."""
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3))))
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


def _packed_schedule(cache, model, seqs, prompts, rng, start_at):
    """Run seqs through packed steps as a scheduler would: sequence s joins at step start_at[s],
    sends its prompt in random chunks, then decodes one token a step, so prefill chunks and
    decodes of different sequences share packs. Yields (logits rows, [(seq, position)], the
    pack's token counts)."""
    plan = {s: [*_chunks(rng, prompts[s]), *((p, p + 1) for p in range(prompts[s], len(seqs[s])))] for s in seqs}
    step_no = 0
    while any(plan.values()):
        ids, counts, toks, spans = [], [], [], []
        for s in seqs:
            if step_no < start_at[s] or not plan[s]:
                continue
            if s not in cache:
                assert cache.add_sequence(s, seqs[s][:prompts[s]]) == 0
            a, b = plan[s].pop(0)
            ids.append(s), counts.append(b - a), toks.append(seqs[s][a:b]), spans.append((s, a, b))
        step_no += 1
        if not ids:
            continue
        flat = [t for tk in toks for t in tk]
        last_only = rng.random() < 0.5                 # the engine's case: one logits row per sequence
        offsets = torch.tensor(counts).cumsum(0)
        want = (offsets - 1) if last_only else None
        step = cache.packed(ids, counts, toks, logits_indices=want)
        out = model(torch.tensor([flat]), step)
        if last_only:
            assert out.shape == (len(ids), V)
            yield out, [(s, b - 1) for s, a, b in spans], counts
        else:
            assert out.shape == (1, len(flat), V)
            yield out[0], [(s, p) for s, a, b in spans for p in range(a, b)], counts


@pytest.mark.parametrize("seed, route", [(0, "few-rows"), (1, "few-rows"), (2, "few-rows"), (3, "few-rows"),
                                         (0, "general"), (1, "general")])
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "mistral"])
@torch.inference_mode()
def test_paged_packed_mixed_steps_match_hf(saved, few_rows, monkeypatch, name, seed, route):
    """Chunked prefill at random split points, packed with other sequences' decodes; on about
    half the steps `logits_indices` asks for each sequence's last row only."""
    if route == "general":
        monkeypatch.setattr(blocks, "ROUTE_ROWS", 0)
    hf, model = saved(name)
    rng = random.Random(seed)
    lengths = {s: rng.randint(6, 26) for s in "abcd"}
    seqs = {s: _tokens(n, seed=100 * seed + i) for i, (s, n) in enumerate(lengths.items())}
    prompts = {s: rng.randint(2, n - 2) for s, n in lengths.items()}
    refs = dict(zip(seqs, _hf(hf, list(seqs.values()))))
    cache = _scattered(model)
    start_at = {s: rng.randint(0, 3) for s in seqs}
    checked, mixed = 0, 0
    for out, where, counts in _packed_schedule(cache, model, seqs, prompts, rng, start_at):
        want = torch.stack([refs[s][p] for s, p in where])
        _close(out, want)
        checked += len(where)
        mixed += min(counts) == 1 < max(counts)                          # a prefill chunk packed with a decode
    assert checked >= sum(n - prompts[s] for s, n in lengths.items())      # every decode at least
    _assert_scattered(cache, list(seqs))
    assert mixed >= 3 and (len(few_rows) > 0) == (route == "few-rows")


@pytest.mark.parametrize("prefix_survives", [True, False])
@torch.inference_mode()
def test_preempted_sequence_recomputed_matches_hf(saved, prefix_survives):
    """A sequence freed mid-decode (preempted) and recomputed from prompt + generated tokens,
    reusing its full blocks from the prefix table when they survive, gives HF's next logits."""
    hf, model = saved("llama-gqa")
    seq, other = _tokens(24, seed=31), _tokens(20, seed=32)
    ref, ref_other = _hf(hf, [seq, other])
    cfg, bs = model.config, 4
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 24, bs)
    cache.add_sequence("a", seq[:10]), cache.add_sequence("b", other[:6])
    out = model(torch.tensor([seq[:10] + other[:6]]), cache.packed(["a", "b"], [10, 6], [seq[:10], other[:6]]))
    _close(out[0, :10], ref[:10]), _close(out[0, 10:], ref_other[:6])
    for p in range(4):                                       # a and b decode side by side
        out = model(torch.tensor([[seq[10 + p], other[6 + p]]]),
                    cache.packed(["a", "b"], [1, 1], [[seq[10 + p]], [other[6 + p]]]))
        _close(out[0, 0], ref[10 + p]), _close(out[0, 1], ref_other[6 + p])
    cache.free("a")                                          # preempted with 14 tokens: 3 full blocks
    if not prefix_survives:                                  # another sequence takes every free block
        cache.add_sequence("hog")
        cache.batch(["hog"], num_new=cache.num_free_blocks * bs)
        cache.free("hog")
    n = cache.add_sequence("a", seq[:14])
    assert n == (12 if prefix_survives else 0)
    last = torch.tensor([14 - n - 1, 14 - n])                # a's last recomputed row, then b's decode
    out = model(torch.tensor([seq[n:14] + [other[10]]]),
                cache.packed(["a", "b"], [14 - n, 1], [seq[n:14], [other[10]]], logits_indices=last))
    _close(out[0], ref[13]), _close(out[1], ref_other[10])
    for p in range(14, 18):
        out = model(torch.tensor([[seq[p]]]), cache.packed(["a"], [1], [[seq[p]]]))
        _close(out[0, 0], ref[p])


# ---------------------------------------------------------------------------- int8 K/V


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
@torch.inference_mode()
def test_int8_kv_within_its_tolerance(saved, name, kind):
    hf, model = saved(name)
    cfg = model.config
    seqs = [_tokens(n, seed=40 + n) for n in (20, 16, 18)]
    refs = _hf(hf, seqs)
    if kind == "contiguous":
        cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 32, cfg.head_dim, kv_dtype="int8")
        err = _contiguous_run(model, seqs, refs, cache, rel=INT8_REL)
    else:
        cache, err = _scattered(model, kv_dtype="int8"), 0.0
        rng = random.Random(7)
        named = dict(zip("abc", seqs))
        prompts = {s: len(t) // 2 for s, t in named.items()}
        for out, where, _ in _packed_schedule(cache, model, named, prompts, rng, dict.fromkeys(named, 0)):
            err = max(err, _close(out, torch.stack([refs["abc".index(s)][p] for s, p in where]), rel=INT8_REL))
    assert err > 0            # int8 really ran: fp32 K/V would be exact to ~1e-6


# ---------------------------------------------------------------------------- pruned, uneven GQA groups


@torch.inference_mode()
def test_pruned_uneven_gqa_groups_match_hf_with_those_heads_silenced(saved):
    """prune_heads leaves groups of 2 and 3 (layer 0) and 3 and 4 (layer 1) query heads per KV
    head (kv_map). HF has no GQA pruning; a removed query head contributes nothing, which in HF
    is its o_proj input columns set to zero."""
    from headwise.analysis.prune import prune_heads
    hf, _ = saved("llama-gqa")
    model = headwise.load(saved.path("llama-gqa"))         # its own copy: pruning is in place
    plan = {0: [0, 1, 5], 1: [2]}
    prune_heads(model, plan)
    assert all(model.layers[i].attn.kv_map is not None for i in (0, 1))
    ref_model, D = copy.deepcopy(hf), model.config.head_dim
    for layer, heads in plan.items():
        for h in heads:
            ref_model.model.layers[layer].self_attn.o_proj.weight[:, h * D:(h + 1) * D] = 0
    seqs = [_tokens(n, seed=50 + n) for n in (20, 16, 18)]
    refs = _hf(ref_model, seqs)
    assert (refs[0] - _hf(hf, seqs[:1])[0]).abs().max() > 1e-2          # the pruning changes the logits
    _close(model(torch.tensor([seqs[0]])), refs[0][None])               # no cache
    cfg = model.config
    cache = ContiguousKVCache(cfg.num_layers, 3, cfg.num_kv_heads, 32, cfg.head_dim)
    _contiguous_run(model, seqs, refs, cache)
    named = dict(zip("abc", seqs))
    for out, where, _ in _packed_schedule(_scattered(model), model, named, {s: 7 for s in named}, random.Random(3),
                                       {"a": 0, "b": 1, "c": 2}):
        _close(out, torch.stack([refs["abc".index(s)][p] for s, p in where]))
