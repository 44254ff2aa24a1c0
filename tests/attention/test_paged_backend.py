"""The `paged` backend against the `math` reference.

K/V are written into a real PagedKVCache (scattered block tables: sequences grow in
turns, so their blocks interleave), and one step - padded (`batch`) or packed with
decodes and prefill chunks side by side - is read through the registry. The reference is
the math backend over the K/V this test kept itself, one sequence at a time, bottom-right
causal, so it shares no code with the cache or the paged backend.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwise.attention import attend, backends, explain
from headwise.attention.backends import paged as paged_backend
from headwise.cache import packed as packed_cache
from headwise.cache.paged import PagedKVCache
from headwise.cache.quantized import dequantize_int8, quantize_int8

D = 8
HEADS = [(2, 2), (4, 2), (4, 1), (6, 2), (3, 1)]  # MHA, GQA, MQA, G=3, MQA with G=3
LAYOUTS = ["default", "spread", "regions"]  # how the pool places blocks


def make_cache(Hkv, block_size, tile_blocks, layout, num_blocks=256, kv_dtype=None):
    return PagedKVCache(
        1,
        Hkv,
        D,
        num_blocks,
        block_size=block_size,
        tile_tokens=tile_blocks * block_size,
        spread=layout == "spread",
        region_blocks=8 if layout == "regions" else None,
        kv_dtype=kv_dtype,
    )


def as_read(cache, x):
    """x as the cache hands it back: int8 K/V are rounded (per token and head) on the way in."""
    return dequantize_int8(*quantize_int8(x)) if cache.kv_dtype == "int8" else x


def grow(cache, kept, seq_ids, rounds, g):
    """Append K/V to the sequences in turns (so their blocks interleave), keeping our own copy."""
    for counts in rounds:
        ids = [s for s, n in zip(seq_ids, counts) if n]
        ns = [n for n in counts if n]
        if not ids:
            continue
        step = cache.batch(ids, ns)
        T, Hkv = max(ns), cache.num_kv_heads
        k, v = torch.randn(len(ids), Hkv, T, D, generator=g), torch.randn(len(ids), Hkv, T, D, generator=g)
        step.layer(0).update(k, v, torch.tensor(ns))
        for b, (s, n) in enumerate(zip(ids, ns)):
            kept[s][0].append(as_read(cache, k[b, :, :n]))
            kept[s][1].append(as_read(cache, v[b, :, :n]))


def reference(q_rows, kept, s, H):
    """math backend over sequence s's K/V as kept by the test: q_rows (H, n, D) -> (H, n, D)."""
    k = torch.cat(kept[s][0], dim=1)[None]  # (1, Hkv, L, D)
    v = torch.cat(kept[s][1], dim=1)[None]
    return attend(q_rows[None], k, v, is_causal=True, backend="math")[0]


@st.composite
def problems(draw):
    H, Hkv = draw(st.sampled_from(HEADS))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    tile_blocks = draw(st.sampled_from([1, 2, 4]))
    n_seqs = draw(st.integers(1, 4))
    rounds = draw(st.lists(st.lists(st.integers(0, 9), min_size=n_seqs, max_size=n_seqs), min_size=1, max_size=4))
    # this step: a decode (1), a prefill chunk (> 1), or nothing, per sequence; at least one
    new = draw(
        st.lists(st.sampled_from([0, 1, 1, 2, 5, 11]), min_size=n_seqs, max_size=n_seqs).filter(lambda xs: any(xs))
    )
    layout = draw(st.sampled_from(LAYOUTS))
    seed = draw(st.integers(0, 2**16))
    return H, Hkv, block_size, tile_blocks, n_seqs, rounds, new, layout, seed


def setup(p):
    H, Hkv, block_size, tile_blocks, n_seqs, rounds, new, layout, seed = p
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(Hkv, block_size, tile_blocks, layout)
    seq_ids = [f"s{i}" for i in range(n_seqs)]
    kept = {s: ([], []) for s in seq_ids}
    for s in seq_ids:
        cache.add_sequence(s)
    grow(cache, kept, seq_ids, rounds, g)
    ids = [s for s, n in zip(seq_ids, new) if n]
    ns = [n for n in new if n]
    return g, cache, kept, ids, ns


@pytest.fixture(params=["flash", "matmul"])
def kernel(request):
    """The CPU flash op on tiles and views, or (as off CPU) fp32 matmuls and no in-place decodes."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "matmul":
            mp.setattr(paged_backend, "_CPU_FLASH", None)
            mp.setattr(packed_cache, "RUNS_OK", False)
        yield request.param


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_packed_step_matches_math(kernel, p):
    """Decodes and prefill chunks of ragged sequences in one packed step, each token over its own
    sequence's scattered blocks, equal the math backend over that sequence alone."""
    H = p[0]
    g, cache, kept, ids, ns = setup(p)
    Hkv = cache.num_kv_heads
    step = cache.packed(ids, ns)
    N = sum(ns)
    k, v = torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g)
    q = torch.randn(1, H, N, D, generator=g)
    read = step.layer(0).update(k, v)
    assert explain(q, read.kv, is_causal=True).chosen == "paged"
    res = read.attend(q, is_causal=True, return_lse=True)
    off = 0
    for s, n in zip(ids, ns):
        kept[s][0].append(k[0, :, off : off + n])
        kept[s][1].append(v[0, :, off : off + n])
        ref = reference(q[0, :, off : off + n], kept, s, H)
        torch.testing.assert_close(res.out[0, :, off : off + n], ref, atol=1e-5, rtol=1e-5)
        off += n
    assert torch.isfinite(res.lse).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_padded_step_matches_math(kernel, p):
    """A padded (`batch`) step of ragged sequences: the real rows equal the math backend."""
    H = p[0]
    g, cache, kept, ids, ns = setup(p)
    Hkv, T = cache.num_kv_heads, max(ns)
    step = cache.batch(ids, ns)
    k, v = torch.randn(len(ids), Hkv, T, D, generator=g), torch.randn(len(ids), Hkv, T, D, generator=g)
    q = torch.randn(len(ids), H, T, D, generator=g)
    read = step.layer(0).update(k, v, torch.tensor(ns))
    out = read.attend(q, is_causal=True, backend="paged")
    for b, (s, n) in enumerate(zip(ids, ns)):
        kept[s][0].append(k[b, :, :n])
        kept[s][1].append(v[b, :, :n])
        torch.testing.assert_close(out[b, :, :n], reference(q[b, :, :n], kept, s, H), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout,kind", [("spread", "runs"), ("regions", "regions"), ("default", "decodes")])
def test_each_decode_path_is_exercised_and_exact(layout, kind):
    """The three decode paths the packed step can plan each run and match the reference."""
    H, Hkv = 4, 2
    g = torch.Generator().manual_seed(0)
    cache = make_cache(Hkv, 4, 2, layout)
    seq_ids = ["a", "b", "c"]
    kept = {s: ([], []) for s in seq_ids}
    for s in seq_ids:
        cache.add_sequence(s)
    grow(cache, kept, seq_ids, [[5, 9, 3], [4, 4, 4], [1, 7, 2]], g)
    step = cache.packed(seq_ids, [1, 1, 6])
    assert kind in {p.kind for p in step.parts} and "chunk" in {p.kind for p in step.parts}
    k, v, q = torch.randn(1, Hkv, 8, D, generator=g), torch.randn(1, Hkv, 8, D, generator=g), torch.randn(1, H, 8, D)
    out = step.layer(0).update(k, v).attend(q, is_causal=True)
    for s, (a, b) in zip(seq_ids, [(0, 1), (1, 2), (2, 8)]):
        kept[s][0].append(k[0, :, a:b])
        kept[s][1].append(v[0, :, a:b])
        torch.testing.assert_close(out[0, :, a:b], reference(q[0, :, a:b], kept, s, H), atol=1e-5, rtol=1e-5)


def test_registry_shows_the_paged_backend_and_why_others_pass():
    """`paged` is registered; explain() names it for a cache read and gives every other backend's
    reason; for plain tensors it is the one passed over, with its reason."""
    assert "paged" in backends()
    cache = make_cache(2, 4, 2, "default")
    cache.add_sequence("a")
    read = cache.batch(["a"], 3).layer(0).update(torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D))
    q = torch.randn(1, 4, 3, D)
    e = explain(q, read.kv, is_causal=True)
    assert e.chosen == "paged"
    assert all(
        "paged cache's blocks" in " ".join(e.rejected[n]) for n in ("flash", "decode", "sdpa", "chunked", "math")
    )
    e = explain(q, read.kv, need_weights=True)
    assert e.chosen is None and "returns no weights" in " ".join(e.rejected["paged"])
    assert explain(q, read.kv, need_weights=True, backend="math").chosen == "math"  # gathers, then the reference
    w = read.attend(q, need_weights=True, backend="math").weights  # (1, 4, 3, 3)
    assert torch.allclose(w.sum(-1), torch.ones(1, 4, 3))
    t = torch.randn(1, 2, 3, D)
    e = explain(q, t, t, is_causal=True)
    assert e.chosen == "prefill" and "not k/v tensors" in " ".join(e.rejected["paged"])
    with pytest.raises(ValueError, match="backend 'paged' cannot serve this request: reads K/V in a paged"):
        attend(q, t, t, backend="paged")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(), int8=st.booleans(), fork_at=st.integers(0, 3))
def test_forked_and_int8_sequences_match_math(kernel, p, int8, fork_at):
    """Copy-on-write forks (two tables sharing the source's blocks, the last one partly filled)
    and int8 pools (tiles dequantized on read) in a packed step: the math backend over each
    sequence's K/V as stored (int8: rounded per token and head) alone."""
    H, Hkv, block_size, tile_blocks, n_seqs, rounds, new, layout, seed = p
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(Hkv, block_size, tile_blocks, layout, kv_dtype="int8" if int8 else None)
    seq_ids = [f"s{i}" for i in range(n_seqs)]
    kept = {s: ([], []) for s in seq_ids}
    for s in seq_ids:
        cache.add_sequence(s)
    grow(cache, kept, seq_ids, rounds[:fork_at], g)
    src = seq_ids[0]
    cache.fork(src, "fork")  # shares every block of s0 so far
    kept["fork"] = (list(kept[src][0]), list(kept[src][1]))
    seq_ids.append("fork")
    grow(cache, kept, seq_ids, [[*r, r[0]] for r in rounds[fork_at:]], g)  # both sides grow alike
    ids = [s for s, n in zip(seq_ids, [*new, 1]) if n]
    ns = [n for n in [*new, 1] if n]
    N = sum(ns)
    k, v = torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g)
    q = torch.randn(1, H, N, D, generator=g)
    out = cache.packed(ids, ns).layer(0).update(k, v).attend(q, is_causal=True)
    off = 0
    for s, n in zip(ids, ns):
        kept[s][0].append(as_read(cache, k[0, :, off : off + n]))
        kept[s][1].append(as_read(cache, v[0, :, off : off + n]))
        torch.testing.assert_close(
            out[0, :, off : off + n], reference(q[0, :, off : off + n], kept, s, H), atol=1e-5, rtol=1e-5
        )
        off += n
    cache.pool.check([cache.block_table(s) for s in seq_ids])  # refcounts add up after the copies


def test_growing_in_turns_scatters_the_tables():
    """What the hypothesis tests rely on: sequences grown in turns get interleaved blocks
    (default layout), so reads cross non-consecutive blocks."""
    g = torch.Generator().manual_seed(1)
    cache = make_cache(2, 2, 1, "default")
    kept = {s: ([], []) for s in "ab"}
    for s in "ab":
        cache.add_sequence(s)
    grow(cache, kept, ["a", "b"], [[3, 3], [4, 2], [5, 5]], g)
    for s in "ab":
        t = cache.block_table(s)
        assert any(t[i + 1] != t[i] + 1 for i in range(len(t) - 1)), t
