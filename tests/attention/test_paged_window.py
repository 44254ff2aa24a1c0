"""Sliding windows and soft-caps on the `paged` backend (issue 40), against a plain-torch reference
over the K/V the test kept itself, one sequence at a time: key j visible from query p iff
p - W < j <= p, scores c * tanh(s / c) before the mask. Blocks wholly outside every query's
window are not read: the test poisons them with NaN (a cache may free or reuse them)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwise.attention import attend_kv, explain

from .test_paged_backend import D, grow, kernel, make_cache, problems, setup  # noqa: F401 (kernel: a fixture)


def reference(q, k, v, window, softcap):
    """q (H, n, D) the last n of L positions; k, v (Hkv, L, D) -> (H, n, D), in fp64."""
    H, n, _ = q.shape
    L, G = k.shape[1], H // k.shape[0]
    k, v = k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    s = q.double() @ k.transpose(-2, -1) * D**-0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p, j = torch.arange(L - n, L)[:, None], torch.arange(L)[None]
    allowed = (j <= p) & (j > p - window if window is not None else True)
    return (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v).float()


def check(out, q_rows, kept, s, window, softcap):
    k, v = torch.cat(kept[s][0], dim=1), torch.cat(kept[s][1], dim=1)
    torch.testing.assert_close(out, reference(q_rows, k, v, window, softcap), atol=2e-5, rtol=1e-4)


CAPS = st.sampled_from([None, None, 0.5, 2.0])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(), window=st.integers(1, 14), softcap=CAPS)
@pytest.mark.usefixtures("kernel")  # the CPU flash op, or fp32 matmuls
def test_packed_step_window_and_softcap(p, window, softcap):
    """Decodes and prefill chunks packed in one step, each over its own sequence's blocks."""
    H = p[0]
    g, cache, kept, ids, ns = setup(p)
    Hkv, N = cache.num_kv_heads, sum(ns)
    step = cache.packed(ids, ns)
    k, v = torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g)
    q = 3 * torch.randn(1, H, N, D, generator=g)
    read = step.layer(0).update(k, v)
    assert explain(q, read.kv, is_causal=True, window=window, softcap=softcap).chosen == "paged"
    # attend_kv: the paged read's own attend() does not take softcap yet (cache/paged_step.py)
    res = attend_kv(q, read.kv, is_causal=True, window=window, softcap=softcap, return_lse=True)
    ref = attend_kv(q, read.kv, is_causal=True, window=window, softcap=softcap, backend="math")  # the reference
    off = 0
    for s, n in zip(ids, ns):
        kept[s][0].append(k[0, :, off : off + n])
        kept[s][1].append(v[0, :, off : off + n])
        check(res.out[0, :, off : off + n], q[0, :, off : off + n], kept, s, window, softcap)
        check(ref[0, :, off : off + n], q[0, :, off : off + n], kept, s, window, softcap)
        off += n
    assert torch.isfinite(res.lse).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(), window=st.integers(1, 14), softcap=CAPS)
@pytest.mark.usefixtures("kernel")
def test_padded_step_window_and_softcap(p, window, softcap):
    """A padded (`batch`) step of ragged sequences: each row's window at its own positions."""
    H = p[0]
    g, cache, kept, ids, ns = setup(p)
    Hkv, T = cache.num_kv_heads, max(ns)
    step = cache.batch(ids, ns)
    k, v = torch.randn(len(ids), Hkv, T, D, generator=g), torch.randn(len(ids), Hkv, T, D, generator=g)
    q = 3 * torch.randn(len(ids), H, T, D, generator=g)
    read = step.layer(0).update(k, v, torch.tensor(ns))
    out = attend_kv(q, read.kv, is_causal=True, window=window, softcap=softcap, backend="paged")
    ref = attend_kv(q, read.kv, is_causal=True, window=window, softcap=softcap, backend="math")
    for b, (s, n) in enumerate(zip(ids, ns)):
        kept[s][0].append(k[b, :, :n])
        kept[s][1].append(v[b, :, :n])
        check(out[b, :, :n], q[b, :, :n], kept, s, window, softcap)
        check(ref[b, :, :n], q[b, :, :n], kept, s, window, softcap)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_blocks_outside_the_window_are_not_read(packed, block_size):
    """Sequences of 30 and 23 keys, window 5: every block that ends before the first query's window
    starts is filled with NaN in the pool; the output stays finite and exact."""
    H, Hkv, W = 4, 2, 5
    g = torch.Generator().manual_seed(0)
    cache = make_cache(Hkv, block_size, 1, "default")  # one block a tile: a tile is out or in
    ids = ["a", "b"]
    kept = {s: ([], []) for s in ids}
    for s in ids:
        cache.add_sequence(s)
    grow(cache, kept, ids, [[12, 9], [18, 14]], g)
    ns = [1, 3]  # a decode and a short chunk
    for s, n in zip(ids, ns):
        first_needed = cache.length(s) + 0 - (W - 1)  # the first query (position L) sees keys > L - W
        for i, blk in enumerate(cache.block_table(s)):
            if (i + 1) * block_size <= first_needed:
                cache._k[0][0][:, blk] = float("nan")
                cache._v[0][0][:, blk] = float("nan")
    T = max(ns)
    if packed:
        step, N = cache.packed(ids, ns), sum(ns)
        k, v, q = (torch.randn(1, h, N, D, generator=g) for h in (Hkv, Hkv, H))
        out = step.layer(0).update(k, v).attend(q, is_causal=True, window=W)
        rows = [(0, slice(0, 1)), (0, slice(1, 4))]
        new = [(k[0, :, r], v[0, :, r]) for _, r in rows]
    else:
        step = cache.batch(ids, ns)
        k, v, q = (torch.randn(2, h, T, D, generator=g) for h in (Hkv, Hkv, H))
        out = step.layer(0).update(k, v, torch.tensor(ns)).attend(q, is_causal=True, window=W)
        rows = [(0, slice(0, 1)), (1, slice(0, 3))]
        new = [(k[0, :, :1], v[0, :, :1]), (k[1, :, :3], v[1, :, :3])]
    assert torch.isfinite(out).all()
    for s, (b, r), (kn, vn) in zip(ids, rows, new):
        kept[s][0].append(kn)
        kept[s][1].append(vn)
        check(out[b, :, r], q[b, :, r], kept, s, W, None)


def test_paged_explain_says_how_the_window_is_handled():
    cache = make_cache(2, 4, 2, "default")
    cache.add_sequence("a")
    read = cache.batch(["a"], 9).layer(0).update(torch.randn(1, 2, 9, D), torch.randn(1, 2, 9, D))
    e = explain(torch.randn(1, 4, 9, D), read.kv, is_causal=True, window=3, softcap=5.0)
    assert e.chosen == "paged"
    text = str(e)
    assert "window: query at position p sees keys [p - 2, p + 0]" in text and "not read" in text
    assert "softcap: scores become 5 * tanh(s / 5)" in text


@pytest.mark.parametrize("tile_blocks", [1, 2, 16])
@pytest.mark.parametrize("window", [3, 6, 13])
def test_a_windowed_chunk_goes_through_the_prefill_kernel(monkeypatch, tile_blocks, window):
    """A prefill chunk of 12 after 20 cached keys: the tile that ends at the last key and starts
    at or before the chunk is read by the C prefill kernel with the window's left edge (and a cap)."""
    from headwise.kernels import prefill as kernel_prefill

    calls = []
    real = kernel_prefill.prefill_attention_unchecked

    def spy(q, k, v, scale, causal, want_lse, window_left=None, softcap=None):
        calls.append((causal, window_left, softcap))
        return real(q, k, v, scale, causal, want_lse, window_left, softcap)

    monkeypatch.setattr(kernel_prefill, "prefill_attention_unchecked", spy)
    g = torch.Generator().manual_seed(1)
    cache = make_cache(2, 4, tile_blocks, "default")
    cache.add_sequence("a")
    kept = {"a": ([], [])}
    grow(cache, kept, ["a"], [[20]], g)
    calls.clear()
    k, v, q = (torch.randn(1, h, 12, D, generator=g) for h in (2, 2, 4))
    read = cache.batch(["a"], 12).layer(0).update(k, v)
    out = read.attend(q, is_causal=True, window=window)
    capped = attend_kv(3 * q, read.kv, is_causal=True, window=window, softcap=0.6)
    kept["a"][0].append(k[0])
    kept["a"][1].append(v[0])
    check(out[0], q[0], kept, "a", window, None)
    check(capped[0], 3 * q[0], kept, "a", window, 0.6)
    if tile_blocks == 16:  # one tile holds every key: the kernel, causal, the window's left edge, the cap
        assert calls == [(True, window - 1, None), (True, window - 1, 0.6)]


@pytest.mark.parametrize("layout,kind", [("spread", "runs"), ("regions", "regions"), ("default", "decodes")])
def test_capped_decodes_read_in_place(monkeypatch, layout, kind):
    """Gemma 2's decodes in a packed step: each in-place decode path hands its cap to the C kernel."""
    from headwise.kernels import attention as kernel_attention

    caps = []
    real = kernel_attention._run

    def spy(*args, **kwargs):
        caps.append(kwargs.get("softcap", args[9] if len(args) > 9 else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_attention, "_run", spy)
    H, Hkv = 4, 2
    g = torch.Generator().manual_seed(0)
    cache = make_cache(Hkv, 4, 2, layout)
    ids = ["a", "b", "c"]
    kept = {s: ([], []) for s in ids}
    for s in ids:
        cache.add_sequence(s)
    grow(cache, kept, ids, [[5, 9, 3], [4, 4, 4], [1, 7, 2]], g)
    step = cache.packed(ids, [1, 1, 6])
    assert kind in {p.kind for p in step.parts}
    k, v, q = torch.randn(1, Hkv, 8, D, generator=g), torch.randn(1, Hkv, 8, D, generator=g), torch.randn(1, H, 8, D)
    caps.clear()
    out = attend_kv(3 * q, step.layer(0).update(k, v).kv, is_causal=True, softcap=0.8)
    assert 0.8 in caps
    for s, (a, b) in zip(ids, [(0, 1), (1, 2), (2, 8)]):
        kept[s][0].append(k[0, :, a:b])
        kept[s][1].append(v[0, :, a:b])
        check(out[0, :, a:b], 3 * q[0, :, a:b], kept, s, None, 0.8)
