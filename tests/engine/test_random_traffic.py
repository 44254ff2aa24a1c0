"""Hypothesis drives random traffic through a small engine: requests of random lengths arrive
between steps, some are aborted at random moments, the pool is small enough to preempt.
After every operation the pool's counts must match the block tables (no block leaked or
double-held); at the end every block is free, and every request that was not aborted
produced exactly its greedy output alone (an aborted one, a prefix of it)."""

from hypothesis import event, given, settings
from hypothesis import strategies as st

from headwise import Engine, SamplingParams

from .conftest import all_blocks_free, reference

V = 96

arrival = st.tuples(st.just("add"), st.lists(st.integers(0, V - 1), min_size=1, max_size=16), st.integers(4, 24))
abort = st.tuples(st.just("abort"), st.integers(0, 50))
steps = st.tuples(st.just("step"), st.integers(1, 4))


@settings(max_examples=20)
@given(
    ops=st.lists(st.one_of(arrival, arrival, abort, steps), min_size=8, max_size=30),
    num_blocks=st.integers(10, 24),
    budget=st.sampled_from([8, 16, 64]),
)
def test_random_arrivals_and_aborts_never_leak_nor_change_outputs(tiny_gpt2, ops, num_blocks, budget):
    engine = Engine(tiny_gpt2, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=8)
    requests, aborted = [], set()
    for op in ops:
        if op[0] == "add":
            _, prompt, n = op
            params = SamplingParams(max_new_tokens=n, temperature=0)
            requests.append((engine.add_request(prompt, params), prompt, params))
        elif op[0] == "abort" and requests:
            rid = requests[op[1] % len(requests)][0]
            if engine.abort(rid):
                aborted.add(rid)
                assert (rid, 0) not in engine.cache
        else:
            for _ in range(op[1]):
                engine.step()
        engine.cache.pool.check([engine.cache.block_table(s) for s in engine.cache.seq_ids()])
    while engine.has_unfinished():
        engine.step()
    assert all_blocks_free(engine)
    event(f"preempted: {engine.stats().preemptions > 0}")  # --hypothesis-show-statistics
    for rid, prompt, params in requests:
        out = engine.result(rid)
        ref = reference(tiny_gpt2, prompt, params)[0].token_ids
        if rid in aborted:
            assert out.finish_reason == "abort" and out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.token_ids == ref and out.finish_reason == "length"
