"""Aborts leave nothing behind: a queued request that is aborted never runs its prefill,
abandoned streams leave the engine's maps, queues and block pool as they were, and the
stats summarise latencies instead of listing every sample."""

import asyncio
import time

import headwise
from headwise import SamplingParams
from headwise.engine import Engine

from .conftest import all_blocks_free, ragged_prompts

LONG = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


def engine_is_empty(engine: Engine) -> bool:
    """Every per-request structure of the engine is empty and every block is free."""
    return (
        not engine._groups
        and not engine._outputs
        and not engine.scheduler.waiting
        and not engine.scheduler.running
        and all_blocks_free(engine)
    )


def test_abort_of_a_queued_request_never_runs_its_prefill(tiny_llama):
    prompts = ragged_prompts(tiny_llama.config.vocab_size, seed=3)
    a, b, c = prompts[5], prompts[11], prompts[9]  # 17, 64 and 45 tokens
    engine = Engine(tiny_llama, num_blocks=64, block_size=8, max_num_seqs=1, max_num_batched_tokens=64)
    engine.add_request(a, LONG, request_id="a")
    engine.step()  # a is running; b and c must wait for its slot
    engine.add_request(b, LONG, request_id="b")
    engine.add_request(c, LONG, request_id="c")
    assert engine.stats().waiting == 2
    assert engine.abort("b")
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s.prefill_tokens == len(a) + len(c)  # b's 64 prompt tokens were never computed
    assert s.requests_aborted == 1 and s.requests_finished == 2
    assert engine.result("a").finish_reason == "length" and engine.result("b").finish_reason == "abort"


def test_many_queued_streams_that_hang_up_cost_no_prefill(tiny_llama):
    """100 clients that go away before their first piece: none of them is prefilled, and the
    engine is idle again as soon as the one running request ends."""
    prompts = ragged_prompts(tiny_llama.config.vocab_size, seed=4)
    engine = Engine(
        tiny_llama,
        num_blocks=128,
        block_size=8,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_waiting_requests=128,
        max_waiting_tokens=100 * 64,
    )

    async def run():
        # long enough to outlast the 50 ms below: the one-call decode step runs this model at ~1 ms a token
        busy = SamplingParams(max_new_tokens=256 - len(prompts[5]), temperature=0, ignore_eos=True)
        first = engine.stream(prompts[5], busy, request_id="busy")
        await anext(first)  # the one slot is taken
        gens = [engine.stream(prompts[11], LONG, request_id=f"gone-{i}") for i in range(100)]
        tasks = [asyncio.ensure_future(anext(g)) for g in gens]
        await asyncio.sleep(0.05)  # every one is queued
        assert engine.stats().waiting == 100
        for t in tasks:
            t.cancel()  # the client hung up
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        assert engine.stats().waiting == 0  # dropped at once, not after a prefill
        async for _ in first:
            pass

    with engine:
        asyncio.run(run())
        deadline = time.time() + 30
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
    s = engine.stats()
    assert s.prefill_tokens == len(prompts[5])
    assert s.requests_aborted == 100
    assert engine_is_empty(engine)


def test_abandoned_streams_leave_no_state_behind(tiny_llama):
    """Streams dropped mid-way (and ones read to the end) keep nothing: no group, no stored
    output, no queue entry, no sequence in the cache, every block free."""
    prompts = ragged_prompts(tiny_llama.config.vocab_size, seed=5)
    engine = Engine(tiny_llama, num_blocks=256, block_size=8, max_num_seqs=8, max_waiting_requests=512)

    async def client(i):
        gen = engine.stream(prompts[i % len(prompts)], LONG, request_id=f"r{i}")
        n = 0
        async for _ in gen:
            n += 1
            if i % 3 and n == 1 + i % 5:  # two in three hang up after a few pieces
                break
        await gen.aclose()

    async def run():
        await asyncio.gather(*(client(i) for i in range(60)))

    with engine:
        asyncio.run(run())
        deadline = time.time() + 10
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
    s = engine.stats()
    assert s.requests_aborted == 40 and s.requests_finished == 20
    assert engine_is_empty(engine)


def test_stats_show_percentiles_not_every_sample(tiny_llama):
    prompts = ragged_prompts(tiny_llama.config.vocab_size, seed=6)
    engine = Engine(tiny_llama, num_blocks=128, block_size=8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    s = engine.stats()
    assert len(s.itl_s) == 12 * 11  # the samples are still there to compute with
    d = s.as_dict()
    for key, count in (("ttft_s", 12), ("itl_s", 12 * 11)):
        summary = d[key]
        xs = sorted(getattr(s, key))
        assert summary["count"] == count
        assert summary["p50"] == xs[(count + 1) // 2 - 1]  # nearest rank
        assert summary["p50"] <= summary["p90"] <= summary["p99"] <= xs[-1]
    text = repr(s)
    assert "p50=" in text and "p99=" in text
    assert len(text) < 1500, text  # 144 floats would not fit
    decode = sum(len(o.token_ids) - 1 for o in outs)
    assert s.decode_tokens_per_second is not None and s.decode_tokens_per_second > 0
    assert decode == 12 * 11


def test_one_token_replies_report_no_decode_rate(tiny_llama):
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = ragged_prompts(tiny_llama.config.vocab_size)[4]
    engine = Engine(tiny_llama, num_blocks=32, block_size=8)
    engine.generate([prompt, prompt], one)
    assert engine.stats().decode_tokens_per_second is None
    res = headwise.generate(tiny_llama, prompt, one)
    assert len(res.token_ids) == 1 and res.tokens_per_second is None
    res = headwise.generate(tiny_llama, prompt, SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True))
    assert res.tokens_per_second == 8 / res.decode_seconds
