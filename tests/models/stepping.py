"""Drivers for the one-forward tests: run a headwise model through cache steps the way
generate() and the engine do, and compare each row with HF's logits at the same position."""

import torch

from headwise.cache import PagedKVCache

from .conftest import V

TOL = 1e-4


def tokens(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, seqs):
    """HF's logits over each whole sequence alone: list of (len, V)."""
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def padded(rows):
    """Right-padded (B, T) input ids of token lists (padding id 0: it must not matter)."""
    T = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (T - len(r)) for r in rows])


def close(got, want, tol=TOL, rel=None):
    """max |got - want| <= tol (or <= rel * max |want|); returns the error."""
    err = (got - want).abs().max().item()
    if rel is not None:
        tol = rel * want.abs().max().item()
    assert got.shape == want.shape and err <= tol, f"max |diff| {err:.2e} > {tol:.1e}"
    return err


def contiguous_run(model, seqs, refs, cache, **tol):
    """Ragged prefill (right-padded), a ragged multi-token step, decodes with rows at different
    lengths, and a decode asking for two rows' logits only; each against refs. Returns max error."""
    B, errs = len(seqs), []
    lens = [len(seqs[0]) // 2, 3, len(seqs[2]) // 3][:B]
    out = model(padded([s[:n] for s, n in zip(seqs, lens)]), cache.step(max(lens), num_new=torch.tensor(lens)))
    errs += [close(out[b, :n], refs[b][:n], **tol) for b, n in enumerate(lens)]
    new = [3, 1, 2][:B]  # rows of one step, real counts differ
    out = model(padded([s[n : n + k] for s, n, k in zip(seqs, lens, new)]), cache.step(3, num_new=torch.tensor(new)))
    errs += [close(out[b, :k], refs[b][n : n + k], **tol) for b, (n, k) in enumerate(zip(lens, new))]
    pos = [n + k for n, k in zip(lens, new)]
    for _ in range(4):  # decodes: every row at its own length
        out = model(torch.tensor([[s[p]] for s, p in zip(seqs, pos)]), cache.step(1))
        errs += [close(out[b, 0], refs[b][p], **tol) for b, p in enumerate(pos)]
        pos = [p + 1 for p in pos]
    want = torch.tensor([B - 1, 0])  # flat rows b * T + t, T = 1
    out = model(torch.tensor([[s[p]] for s, p in zip(seqs, pos)]), cache.step(1, logits_indices=want))
    assert out.shape == (2, V) and out.dtype == torch.float32
    errs += [close(out[0], refs[B - 1][pos[B - 1]], **tol), close(out[1], refs[0][pos[0]], **tol)]
    return max(errs)


def scattered(model, num_blocks=96, block_size=4, **kw):
    """A paged cache whose free blocks are every other one: the other half is held by idle
    sequences, so the tables the test's sequences get are not consecutive."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, **kw)
    for i in range(num_blocks):
        cache.add_sequence(("hold", i))
        cache.batch([("hold", i)], num_new=block_size)  # reserves a block; never run, never read
    for i in range(0, num_blocks, 2):
        cache.free(("hold", i))
    return cache


def assert_scattered(cache, seq_ids):
    tables = [cache.block_table(s) for s in seq_ids]
    assert any(t[i + 1] != t[i] + 1 for t in tables for i in range(len(t) - 1)), tables


def chunks(rng, n):
    """Cut n prompt tokens into 1-4 chunks at random points: a list of (start, stop)."""
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3))))
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


def packed_schedule(cache, model, seqs, prompts, rng, start_at):
    """Run seqs through packed steps as a scheduler would: sequence s joins at step start_at[s],
    sends its prompt in random chunks, then decodes one token a step, so prefill chunks and
    decodes of different sequences share packs. Yields (logits rows, [(seq, position)], the
    pack's token counts)."""
    plan = {s: [*chunks(rng, prompts[s]), *((p, p + 1) for p in range(prompts[s], len(seqs[s])))] for s in seqs}
    step_no = 0
    while any(plan.values()):
        ids, counts, toks, spans = [], [], [], []
        for s in seqs:
            if step_no < start_at[s] or not plan[s]:
                continue
            if s not in cache:
                assert cache.add_sequence(s, seqs[s][: prompts[s]]) == 0
            a, b = plan[s].pop(0)
            ids.append(s), counts.append(b - a), toks.append(seqs[s][a:b]), spans.append((s, a, b))
        step_no += 1
        if not ids:
            continue
        flat = [t for tk in toks for t in tk]
        last_only = rng.random() < 0.5  # the engine's case: one logits row per sequence
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
