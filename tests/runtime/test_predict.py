"""Predicted Outputs (runtime/predict.py): a request's prediction changes how many tokens a step
computes, never which tokens come out. The reference is the same engine without a prediction
(one token per decode step), and generate(): for greedy decoding, for seeded sampling (each token
takes one draw of the request's generator, drafted or not), with penalties, in batches mixed with
requests that carry no prediction. The cache's truncate is held to a pool that never held the
dropped tokens."""

import pytest
import torch

import headwise
from headwise import Engine, EngineConfig, SamplingParams
from headwise.cache.paged import PagedKVCache

from ..engine.conftest import all_blocks_free, reference

PROMPTS = [[5, 17, 3, 99, 42, 7], [1, 2, 3], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73]]


def edited(ids: list[int], V: int) -> list[int]:
    """ids with three tokens changed a third of the way in and one dropped at two thirds: the
    output leaves the prediction twice and must find its way back."""
    out = list(ids)
    a, b = len(out) // 3, 2 * len(out) // 3
    out[a : a + 3] = [(t + 1) % V for t in out[a : a + 3]]
    del out[b]
    return out


def engine_of(model, **kw):
    return Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, **kw))


def run(engine, prompts, params_list):
    outs = engine.generate(prompts, params_list)
    assert all_blocks_free(engine)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalized"])
def test_output_is_what_plain_decoding_gives(tiny_llama, kind):
    V = tiny_llama.config.vocab_size
    base = dict(max_new_tokens=40)
    if kind == "greedy":
        base.update(temperature=0)
    elif kind == "seeded":
        base.update(temperature=0.8, top_p=0.9, seed=7)
    else:
        base.update(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    plain = SamplingParams(**base)
    engine = engine_of(tiny_llama)
    expected = run(engine, PROMPTS, [plain] * len(PROMPTS))
    if kind == "greedy":  # the plain engine itself agrees with generate()'s contiguous cache
        assert [e.token_ids for e in expected] == [reference(tiny_llama, p, plain)[0].token_ids for p in PROMPTS]
    g = torch.Generator().manual_seed(3)
    predictions = {
        "exact": [e.token_ids for e in expected],
        "edited": [edited(e.token_ids, V) for e in expected],
        "unrelated": [torch.randint(0, V, (40,), generator=g).tolist() for _ in PROMPTS],
    }
    for name, preds in predictions.items():
        # the prompts in one batch, one without a prediction: drafts of some rows beside plain decodes
        params = [SamplingParams(**base, prediction=tuple(p)) for p in preds[:-1]] + [plain]
        got = run(engine, PROMPTS, params)
        assert [o.token_ids for o in got] == [e.token_ids for e in expected], name
        kept = sum(o.accepted_prediction_tokens for o in got)
        if name == "exact":  # the whole output was predicted, and nothing drafted was wrong
            assert all(o.accepted_prediction_tokens == len(o.token_ids) for o in got[:-1]), name
            assert all(o.rejected_prediction_tokens == 0 for o in got[:-1]), name
        elif name == "edited":
            assert kept > 0 and sum(o.rejected_prediction_tokens for o in got) > 0, name
        assert got[-1].accepted_prediction_tokens == got[-1].rejected_prediction_tokens == 0
    stats = engine.stats()  # what /metrics shows: headwise_engine_draft_tokens{,_accepted}
    assert stats.draft_tokens > stats.draft_tokens_accepted > 0


def test_drafts_need_fewer_steps(tiny_llama):
    """The point of it: an output that follows its prediction takes far fewer forwards."""
    plain = SamplingParams(temperature=0, max_new_tokens=60)
    engine = engine_of(tiny_llama)
    ids = run(engine, [PROMPTS[0]], [plain])[0].token_ids
    steps = engine.core.counts["steps"]
    run(engine, [PROMPTS[0]], [SamplingParams(temperature=0, max_new_tokens=60, prediction=tuple(ids))])
    assert engine.core.counts["steps"] - steps < steps / 3


def test_streamed_pieces_carry_every_token_once(tiny_llama):
    ids = run(engine_of(tiny_llama), [PROMPTS[1]], [SamplingParams(temperature=0, max_new_tokens=30)])[0].token_ids
    engine = engine_of(tiny_llama)
    pieces = []
    engine.add_request(
        PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=30, prediction=tuple(ids)), on_piece=pieces.append
    )
    while engine.has_unfinished():
        engine.step()
    assert [t for p in pieces for t in p.token_ids] == ids
    assert [p.finish_reason for p in pieces].count("length") == 1 and pieces[-1].finish_reason == "length"
    assert len(pieces) < len(ids) / 3  # several tokens per piece
    assert pieces[-1].accepted_prediction_tokens == len(ids)


def test_bad_predictions_are_refused(tiny_llama):
    V = tiny_llama.config.vocab_size
    engine = engine_of(tiny_llama)
    with pytest.raises(ValueError, match="prediction token id 128 is out of range"):
        engine.add_request([1, 2], SamplingParams(prediction=(1, V)))
    with pytest.raises(ValueError, match="prediction must be token ids"):
        SamplingParams(prediction=(1, -2))
    with pytest.raises(ValueError, match="runs in the Engine"):
        headwise.generate(tiny_llama, [1, 2], SamplingParams(max_new_tokens=4, prediction=(1, 2)))


def test_truncate_drops_blocks_and_prefixes():
    """Truncating then writing other tokens reads back as a sequence that never held the dropped ones."""
    torch.manual_seed(0)
    L, H, D, bs = 2, 2, 4, 4
    cache = PagedKVCache(L, H, D, num_blocks=16, block_size=bs)
    fresh = PagedKVCache(L, H, D, num_blocks=16, block_size=bs)
    kv = {t: (torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)) for t in range(40)}  # K/V of token id t

    def write(c, seq, toks):
        step = c.batch([seq], len(toks), [toks])
        for layer in range(L):
            k = torch.cat([kv[t][0] for t in toks], dim=2)
            v = torch.cat([kv[t][1] for t in toks], dim=2)
            step.layer(layer).update(k, v)

    kept, dropped, after = list(range(10)), [30, 31, 32, 33, 34, 35], [20, 21, 22, 23, 24, 25]
    cache.add_sequence("a")
    write(cache, "a", kept + dropped)  # fills blocks 0-3: blocks 2 and 3 hold dropped tokens
    free = cache.num_free_blocks
    cache.truncate("a", len(kept), kept)
    assert cache.length("a") == len(kept) and cache.num_free_blocks == free + 1  # block 3 back to the pool
    write(cache, "a", after)
    fresh.add_sequence("a")
    write(fresh, "a", kept + after)
    for layer in range(L):
        got, want = cache.read_sequence("a", layer), fresh.read_sequence("a", layer)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # only prefixes of tokens the sequence holds are findable: its first 4 blocks, not the dropped ones
    cache.add_sequence("b", kept + after + [1])
    assert cache.block_table("b") == cache.block_table("a")[:4]
    cache.add_sequence("c", kept + dropped + [1])
    assert cache.block_table("c") == cache.block_table("a")[:2]
    cache.pool.check([cache.block_table(s) for s in cache.seq_ids()])
    with pytest.raises(ValueError, match="truncate length must be an int in"):
        cache.truncate("a", 99)
