"""Packed (varlen) steps over the paged cache against each sequence's full pass.

The oracle is the same MultiHeadAttention with no cache over each whole sequence
(is_causal=True). A packed step lays several sequences' new tokens on one axis, decodes
and prefill chunks mixed; every token must get exactly what the full pass gives it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import MultiHeadAttention
from headwise.attention.backends import paged as paged_backend
from headwise.cache import packed, paged
from headwise.cache.paged import PagedKVCache

C, BS, TILE = 32, 4, 8


def layer(H=4, Hkv=2, rope=True):
    return MultiHeadAttention(C, H, Hkv, rope=rope).eval()


def run_schedule(m, xs, schedule, num_blocks=64, backend=None, spread=False, kinds=None, region_blocks=None):
    """Feed sequences xs[name] (1, T, C) by packed steps; schedule: list of {name: num_new}.
    Returns each sequence's outputs (1, T, C), concatenated over steps. kinds: a set that
    collects how the steps' parts were read ("runs", "decodes", "chunk")."""
    cache = PagedKVCache(
        1,
        m.num_kv_heads,
        m.head_dim,
        num_blocks,
        block_size=BS,
        tile_tokens=TILE,
        spread=spread,
        region_blocks=region_blocks,
    )
    done = {s: 0 for s in xs}
    outs = {s: [] for s in xs}
    for s in xs:
        cache.add_sequence(s)
    if backend:
        m.backend = backend
    with torch.no_grad():
        for step in schedule:
            ids = [s for s, n in step.items() if n]
            counts = [step[s] for s in ids]
            x = torch.cat([xs[s][:, done[s] : done[s] + n] for s, n in zip(ids, counts)], dim=1)  # (1, N, C)
            step = cache.packed(ids, counts)
            if kinds is not None:
                kinds.update(p.kind for p in step.parts)
            y = m(x, is_causal=True, cache=step)
            off = 0
            for s, n in zip(ids, counts):
                outs[s].append(y[:, off : off + n])
                off += n
                done[s] += n
    pool = cache.pool
    pool.check([cache.block_table(s) for s in xs])
    return {s: torch.cat(o, dim=1) for s, o in outs.items()}


def check(m, xs, outs, tol=1e-5):
    with torch.no_grad():
        for s, x in xs.items():
            ref = m(x, is_causal=True)
            assert (outs[s] - ref).abs().max().item() <= tol, s


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("kernel", ["flash", "matmul"])
def test_decodes_and_prefill_chunks_in_one_step_match_full_passes(H, Hkv, kernel, monkeypatch):
    if kernel == "matmul":
        monkeypatch.setattr(paged_backend, "_CPU_FLASH", None)
        monkeypatch.setattr(packed, "RUNS_OK", False)
    m = layer(H, Hkv)
    xs = {s: torch.randn(1, T, C) for s, T in (("a", 21), ("b", 9), ("c", 30), ("d", 2))}
    schedule = [
        {"a": 10, "b": 9, "c": 5, "d": 1},  # prefill chunks of different lengths
        {"a": 1, "d": 1, "c": 12},  # one-token rows (read as decodes) and a chunk
        {"a": 10, "c": 13},
    ]
    check(m, xs, run_schedule(m, xs, schedule))


@pytest.mark.parametrize("path", ["runs", "decodes", "fallback"])
def test_decodes_read_in_place_or_through_read_plans(path, monkeypatch):
    """Decode rows whose sequence is one consecutive run of blocks are read in place ("runs":
    one kernel call per sequence on a view of the pool); others, or every one without the
    CPU flash kernel, through a batched read plan ("decodes"); "runs" rows that a layer call
    cannot serve in place (here backend="math") fall back to a read plan too."""
    if path == "decodes":
        monkeypatch.setattr(packed, "RUNS_OK", False)
    m = layer(4, 2)
    xs = {s: torch.randn(1, T, C) for s, T in (("a", 13), ("b", 7), ("c", 10))}
    schedule = [{"a": 5, "b": 3, "c": 6}] + [{"a": 1, "b": 1, "c": 1}] * 4 + [{"a": 4}]
    kinds = set()
    outs = run_schedule(m, xs, schedule, spread=True, kinds=kinds, backend="math" if path == "fallback" else None)
    check(m, xs, outs)
    assert ("runs" in kinds) == (path != "decodes") and ("decodes" in kinds) == (path == "decodes")


@pytest.mark.parametrize("occupancy", ["dense", "sparse", "mixed"])
def test_decodes_of_region_aligned_sequences_read_as_one_strided_view(occupancy):
    """Sequences that start a region (here 4 blocks of 4 tokens) and fit in it are decoded by
    one kernel call over a strided view of the pool; one that outgrows its region, or regions
    left empty in between, are still exact."""
    m = layer(4, 2)
    lengths = {"dense": (5, 9, 12, 3), "sparse": (5, 9, 12, 3), "mixed": (5, 30, 12, 3)}[occupancy]
    xs = {s: torch.randn(1, T, C) for s, T in zip("abcd", lengths)}
    first = {s: x.shape[1] - 3 for s, x in xs.items()}
    schedule = [dict(first)] + [{s: 1 for s in xs}] * 3
    if occupancy == "sparse":  # z fills region 1 and stops; a, c, d, b decode in regions 0, 2, 3, 4
        xs["z"] = torch.randn(1, 6, C)
        schedule = [{"a": first["a"], "z": 6}, {"c": first["c"], "d": first["d"]}, {"b": first["b"]}] + [
            {s: 1 for s in "abcd"}
        ] * 3
    kinds = set()
    outs = run_schedule(m, xs, schedule, num_blocks=40, spread=True, region_blocks=4, kinds=kinds)
    check(m, xs, outs)
    assert "regions" in kinds
    assert ("runs" in kinds) == (occupancy == "mixed")  # b (30 tokens) outgrew its 16-token region


def test_spread_keeps_growing_sequences_consecutive():
    """New runs start mid-way into the largest free stretch, so sequences growing side by
    side keep their blocks consecutive; without spread they interleave."""
    for spread, consecutive in ((True, True), (False, False)):
        cache = PagedKVCache(1, 1, 2, 64, block_size=2, spread=spread)
        for s in "abcd":
            cache.add_sequence(s)
            cache.packed([s], [3])  # 2 blocks each
        for _ in range(8):
            cache.packed(list("abcd"), [1] * 4)  # grow together by 4 blocks
        tables = [cache.block_table(s) for s in "abcd"]
        assert all((t == list(range(t[0], t[0] + len(t)))) == consecutive for t in tables[:3])
        cache.pool.check(tables)
    pool = paged.BlockPool(16)
    assert pool.allocate(2, spread=True) == [0, 1]  # nothing before: start at the start
    assert pool.allocate(1, spread=True) == [2 + 14 // 2]  # middle of the stretch 2..15
    assert pool.allocate(1, prefer=1, spread=True) == [2]  # a run continues where it can
    pool = paged.BlockPool(16)
    assert pool.allocate(2, region=4) == [0, 1]  # new sequences start free regions
    assert pool.allocate(1, region=4) == [4]
    pool.allocate(1, prefer=4)  # 5
    assert pool.allocate(3, region=4) == [8, 9, 10]
    pool.release(4)
    assert pool.allocate(1, region=4, spread=True) == [12]  # region 1 still holds block 5
    assert pool.allocate(1, region=4) == [2]  # no free region left: first free block


def test_decode_rows_not_contiguous_in_the_pack():
    """Decodes between prefill chunks are read together through an index, not a slice."""
    m = layer(4, 2)
    xs = {s: torch.randn(1, T, C) for s, T in (("a", 6), ("b", 12), ("c", 6), ("d", 12))}
    schedule = [{"a": 5, "b": 4, "c": 5, "d": 4}, {"a": 1, "b": 8, "c": 1, "d": 8}]
    outs = run_schedule(m, xs, schedule)
    check(m, xs, outs)


def test_math_backend_reference_path_agrees():
    m = layer(4, 2)
    xs = {s: torch.randn(1, T, C) for s, T in (("a", 11), ("b", 7))}
    schedule = [{"a": 6, "b": 7}, {"a": 5}]
    check(m, xs, run_schedule(m, xs, schedule, backend="math"))


@settings(max_examples=25)
@given(st.data())
def test_any_schedule_matches_full_passes(data):
    """Random lengths and random per-step chunk sizes, rope on, GQA."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    m = layer(4, 2)
    lengths = data.draw(st.lists(st.integers(1, 24), min_size=1, max_size=5))
    xs = {f"s{i}": torch.randn(1, T, C) for i, T in enumerate(lengths)}
    chunks = {}  # each sequence: its chunk sizes, and the step it starts at (arrivals)
    for s, x in xs.items():
        T = x.shape[1]
        cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), max_size=4)) if T > 1 else [])
        bounds = [0, *cuts, T]
        chunks[s] = (data.draw(st.integers(0, 3)), [b - a for a, b in zip(bounds, bounds[1:])])
    last = max(start + len(c) for start, c in chunks.values())
    schedule = [{s: c[j - start] for s, (start, c) in chunks.items() if 0 <= j - start < len(c)} for j in range(last)]
    schedule = [step for step in schedule if step]
    check(m, xs, run_schedule(m, xs, schedule))


def test_prefix_registration_waits_for_commit_when_deferred():
    cache = PagedKVCache(2, 1, 2, 8, block_size=2)
    cache.add_sequence("a")
    step = cache.packed(["a"], [4], [[1, 2, 3, 4]], defer_prefix=True)
    kv = torch.ones(1, 1, 4, 2)
    step.layer(0).update(kv, kv)
    step.layer(1).update(kv, kv)
    assert cache.add_sequence("early", [1, 2, 3, 4, 5]) == 0  # written, not yet committed
    assert step.commit() == 2
    assert cache.add_sequence("late", [1, 2, 3, 4, 5]) == 4


def test_commit_skips_blocks_freed_during_the_step():
    cache = PagedKVCache(1, 1, 2, 8, block_size=2)
    cache.add_sequence("a")
    step = cache.packed(["a"], [4], [[1, 2, 3, 4]], defer_prefix=True)
    kv = torch.ones(1, 1, 4, 2)
    step.layer(0).update(kv, kv)
    cache.free("a")  # aborted while the step ran
    assert step.commit() == 0
    assert cache.pool.num_free == 8
    cache.pool.check()


def test_bad_input_names_the_problem():
    cache = PagedKVCache(1, 2, 8, 8, block_size=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    with pytest.raises(ValueError, match="num_new is 0 for \\['b'\\]"):
        cache.packed(["a", "b"], [2, 0])
    step = cache.packed(["a", "b"], [2, 1])
    k = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"\(1, Hkv, N, D\) = \(1, 2, 3, 8\)"):
        step.update(torch.zeros(2, 2, 3, 8), k)
    with pytest.raises(ValueError, match="no padding"):
        step.update(k, k, torch.tensor([3]))
    with pytest.raises(ValueError, match=r"positions\(2\) but this packed step holds N=3"):
        step.positions(2)
    read = step.update(k, k)
    with pytest.raises(ValueError, match="no attn_mask or key_padding_mask"):
        read.attend(torch.zeros(1, 4, 3, 8), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"q must be \(1, H, N, D\) = \(1, H, 3, 8\)"):
        read.attend(torch.zeros(1, 4, 2, 8))
