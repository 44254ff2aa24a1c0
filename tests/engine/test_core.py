"""The engine's parts on their own: the core speaks token ids (no tokenizer, no text), the
runner computes the output layer for the sampled rows only, and the whole engine with 1 and
with 16 requests gives what generate() gives one prompt at a time."""

import torch

from headwise import Engine, SamplingParams
from headwise.engine import EngineConfig, EngineCore
from headwise.runtime.request import RequestGroup, Status

from .conftest import all_blocks_free, ragged_prompts, reference


def test_core_runs_token_ids_in_and_out(tiny_gpt2):
    """A model without a tokenizer: ids in, ids out, equal to generate() on each prompt alone."""
    assert getattr(tiny_gpt2, "tokenizer", None) is None
    core = EngineCore(tiny_gpt2, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4))
    prompts = ragged_prompts(96, seed=4)[:6]
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (7, 3, 9, 1, 5, 8)]
    requests = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        r = core.request(RequestGroup(f"r{i}", p, sp, None), 0)
        core.add(r)
        requests.append(r)
    seen = {id(r): [] for r in requests}
    while core.scheduler.has_work():
        for out in core.step():
            assert isinstance(out.token, int)
            seen[id(out.request)].append(out.token)
    for p, sp, r in zip(prompts, params, requests):
        ref = reference(tiny_gpt2, p, sp)[0]
        assert r.status is Status.FINISHED and r.text.text == ""  # no tokenizer: no text
        assert r.output_token_ids == seen[id(r)] == ref.token_ids
        assert r.finish_reason == ref.finish_reason == "length"
    assert not core.cache.seq_ids()


def test_runner_computes_logits_for_sampled_rows_only(tiny_llama):
    """A counting hook on lm_head: each step it sees R rows (the chunks that get a token),
    never the step's N packed tokens (one row when a step samples nothing)."""
    engine = Engine(tiny_llama, num_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    runner = engine.core.runner
    batches, rows_seen = [], []
    prepare = runner.prepare

    def spy(chunks):
        batch = prepare(chunks)
        batches.append((batch.num_tokens, len(batch.rows)))
        return batch

    runner.prepare = spy
    handle = tiny_llama.lm_head.register_forward_hook(
        lambda mod, args, out: rows_seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    try:
        prompts = (
            ragged_prompts(tiny_llama.config.vocab_size, seed=5)[-1:]
            + ragged_prompts(tiny_llama.config.vocab_size, seed=5)[:5]
        )  # 64 tokens first: steps that sample nothing
        greedy = SamplingParams(max_new_tokens=5, temperature=0)
        outs = engine.generate(prompts, greedy)
    finally:
        handle.remove()
    assert [o.token_ids for o in outs] == [reference(tiny_llama, p, greedy)[0].token_ids for p in prompts]
    assert rows_seen == [max(1, r) for _, r in batches]
    assert sum(n for n, _ in batches) > sum(rows_seen)  # prefill rows got no logits
    assert any(r == 0 for _, r in batches) and any(n > r > 1 for n, r in batches)


def test_one_and_sixteen_requests_equal_generate(tiny):
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    V = tiny.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (16,), generator=g)]
    for batch in (prompts[:1], prompts):
        engine = Engine(tiny, num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
        outs = engine.generate(batch, greedy)
        assert [o.token_ids for o in outs] == [reference(tiny, p, greedy)[0].token_ids for p in batch]
        assert all_blocks_free(engine)
    assert engine.stats().steps < 16 * 10  # the 16 shared their steps


def test_an_engine_sees_a_hook_added_between_two_steps(tiny_llama):
    """The engine takes the model as it is at every step: a hook added between two decode steps
    of a request runs at each later step (the executor is chosen again once the hook is there),
    and a second generate() of the same engine gives the same tokens."""
    prompt = ragged_prompts(tiny_llama.config.vocab_size, seed=9)[2]
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    plain = reference(tiny_llama, prompt, greedy)[0].token_ids
    engine = Engine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=2)
    assert engine.generate([prompt], greedy)[0].token_ids == plain
    assert engine.generate([prompt], greedy)[0].token_ids == plain
    engine, calls = Engine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=2), []
    rid = engine.add_request(prompt, greedy)
    for _ in range(4):  # the prefill, then decode steps from the stack's memo
        engine.step()
    handle = tiny_llama.layers[1].mlp.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    try:
        while not engine.step():
            pass
    finally:
        handle.remove()
    assert len(calls) == 10 - 4 and engine.result(rid).token_ids == plain  # the hook changed nothing


def test_generate_looks_again_after_another_requests_callback_ran(tiny_llama):
    """Another request's on_piece callback that adds a hook in the middle of generate() is
    followed by a step that sees it, and the hook runs at every later step."""
    other, prompt = ragged_prompts(tiny_llama.config.vocab_size, seed=9)[1:3]
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    engine, calls, added = Engine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=2), [], []

    def on_piece(piece):
        if len(piece.token_ids) and not added and engine.core.counts["output_tokens"] >= 6:
            added.append(engine.core.counts["steps"])
            added.append(tiny_llama.layers[1].mlp.register_forward_hook(lambda m, a, out: calls.append(out.shape)))

    rid = engine.add_request(
        other, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True), on_piece=on_piece
    )
    try:
        out = engine.generate([prompt], greedy)[0]
        while engine.has_unfinished():
            engine.step()
    finally:
        if added:
            added[1].remove()
    assert out.token_ids == reference(tiny_llama, prompt, greedy)[0].token_ids  # the hook changed nothing
    assert (
        engine.result(rid).token_ids
        == reference(tiny_llama, other, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0].token_ids
    )
    assert added and len(calls) == engine.core.counts["steps"] - added[0] > 0  # every step after the hook ran it
