"""The engine as a server uses it: the background thread, async streams, aborts, the queue
limit, shutdown and failure. Outputs are held to headwise.generate one prompt at a time."""

import asyncio
import time

import pytest

from headwise import Engine, QueueFull, SamplingParams
from headwise.engine import StreamPiece, frontends

from .conftest import all_blocks_free, ragged_prompts, reference

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
LONG = SamplingParams(max_new_tokens=60, temperature=0)


async def collect(agen, stop_after: int | None = None) -> list[StreamPiece]:
    pieces = []
    async for piece in agen:
        pieces.append(piece)
        if stop_after is not None and len(pieces) == stop_after:
            await agen.aclose()
            break
    return pieces


def test_concurrent_streams_equal_generate(tiny):
    prompts = ragged_prompts(tiny.config.vocab_size, seed=7)
    params = [GREEDY, SamplingParams(max_new_tokens=9, temperature=0.9, top_k=30, seed=3, n=2)] * 6

    async def main(engine):
        return await asyncio.gather(*(collect(engine.stream(p, sp)) for p, sp in zip(prompts, params)))

    with Engine(tiny, num_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=8) as engine:
        streams = asyncio.run(main(engine))
        assert engine.stats().steps < sum(sp.max_new_tokens * sp.n for sp in params)  # they shared steps
    for p, sp, pieces in zip(prompts, params, streams):
        refs = reference(tiny, p, sp)
        for j, ref in enumerate(refs):
            mine = [x for x in pieces if x.index == j]
            assert [t for x in mine for t in x.token_ids] == ref.token_ids
            assert [x.finish_reason for x in mine] == [None] * (len(mine) - 1) + [ref.finish_reason]
            assert [x.num_output_tokens for x in mine] == list(range(1, len(ref.token_ids) + 1))
            assert all(x.num_prompt_tokens == len(p) for x in mine)
    assert all_blocks_free(engine)


def test_closing_a_stream_aborts_it_and_frees_its_blocks_at_once(tiny_gpt2):
    """A client that goes away (the async generator closed after 3 pieces) while another
    request keeps running: its sequence leaves the cache before aclose() returns."""
    prompts = ragged_prompts(96, seed=8)
    seen = {}

    async def main(engine):
        async def leaver():
            agen = engine.stream(prompts[9], LONG, request_id="leaver")
            pieces = await collect(agen, stop_after=3)
            seen["in_cache"] = ("leaver", 0) in engine.cache
            seen["aborted"] = engine.stats().requests_aborted
            return pieces

        return await asyncio.gather(leaver(), collect(engine.stream(prompts[10], LONG)))

    with Engine(tiny_gpt2, num_blocks=96, block_size=4) as engine:
        left, stayed = asyncio.run(main(engine))
        assert len(left) == 3 and seen == {"in_cache": False, "aborted": 1}
        assert engine.abort("leaver") is False  # already gone
    assert [t for x in stayed for t in x.token_ids] == reference(tiny_gpt2, prompts[10], LONG)[0].token_ids
    assert (
        left[0].token_ids + left[1].token_ids + left[2].token_ids
        == reference(tiny_gpt2, prompts[9], LONG)[0].token_ids[:3]
    )
    assert all_blocks_free(engine)


def test_abort_frees_blocks_at_once_and_leaves_others_alone(tiny_llama):
    """Stepped by hand: after abort() returns, the request's blocks are free and the pool's
    counts add up; the other requests finish exactly as they would alone."""
    prompts = ragged_prompts(128, seed=9)[6:9]
    engine = Engine(tiny_llama, num_blocks=64, block_size=4, max_num_seqs=4)
    ids = [engine.add_request(p, LONG) for p in prompts]
    for _ in range(5):
        engine.step()
    victim = (ids[1], 0)
    own = len(engine.cache.block_table(victim))
    used = engine.stats().kv_blocks_used
    assert engine.abort(ids[1]) is True
    assert victim not in engine.cache and engine.stats().kv_blocks_used == used - own
    assert engine.stats().running == 2 and engine.stats().requests_aborted == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.result(ids[1]).finish_reason == "abort"
    assert engine.result(ids[1]).token_ids == reference(tiny_llama, prompts[1], LONG)[0].token_ids[:5]
    for i in (0, 2):
        assert engine.result(ids[i]).token_ids == reference(tiny_llama, prompts[i], LONG)[0].token_ids
    assert all_blocks_free(engine)


def test_abort_while_a_step_runs_on_the_thread(tiny_gpt2):
    """Aborts from another thread land between or during forwards; each frees at once."""
    prompts = ragged_prompts(96, seed=10)
    got: dict[str, list] = {}
    with Engine(tiny_gpt2, num_blocks=128, block_size=4, max_num_seqs=12) as engine:
        ids = [
            engine.add_request(p, LONG, on_piece=lambda x, i=i: got.setdefault(i, []).append(x))
            for i, p in enumerate(prompts)
        ]
        while engine.stats().output_tokens < 40:
            time.sleep(0.001)
        for rid in ids[::3]:
            assert engine.abort(rid)
            assert (rid, 0) not in engine.cache
        outs = [engine.result(rid, timeout=60) for rid in ids]
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = reference(tiny_gpt2, p, LONG)[0].token_ids
        if i % 3 == 0:
            assert out.finish_reason == "abort" and out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.token_ids == ref
        assert got[i][-1].finish_reason == out.finish_reason
        assert [t for x in got[i] for t in x.token_ids] == out.token_ids
    assert all_blocks_free(engine)


def test_queue_full_refuses_and_changes_nothing(tiny_gpt2):
    prompts = ragged_prompts(96, seed=11)
    engine = Engine(tiny_gpt2, num_blocks=64, block_size=4, max_waiting_requests=2, max_waiting_tokens=40)
    a = engine.add_request(prompts[4], GREEDY)  # 16 tokens
    b = engine.add_request(prompts[5], GREEDY)  # 17 tokens
    before = engine.stats()
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(max_waiting_requests=2\)") as e:
        engine.add_request(prompts[0], GREEDY)
    assert isinstance(e.value, RuntimeError) and e.value.retry_after >= 1.0
    assert engine.stats() == before

    async def refused():
        agen = engine.stream(prompts[0], GREEDY)  # nothing happens until the first __anext__
        with pytest.raises(QueueFull):
            await agen.__anext__()

    asyncio.run(refused())
    assert engine.stats() == before
    engine.step()  # both admitted: the queue is empty again
    assert engine.stats().waiting == 0
    engine.add_request(prompts[6], GREEDY)  # 34 tokens: fits 40
    with pytest.raises(QueueFull, match="34 prompt tokens are waiting and this request adds 9"):
        engine.add_request(prompts[3], GREEDY)
    with pytest.raises(ValueError, match="more than the waiting queue ever holds"):
        engine.add_request(prompts[11], GREEDY)  # 64 tokens: never
    with engine:
        assert engine.result(a, timeout=60).token_ids == reference(tiny_gpt2, prompts[4], GREEDY)[0].token_ids
        assert engine.result(b, timeout=60).token_ids == reference(tiny_gpt2, prompts[5], GREEDY)[0].token_ids


def test_shutdown_aborts_what_is_left(tiny_gpt2):
    engine = Engine(tiny_gpt2, num_blocks=32, block_size=4)
    pieces = []
    rid = engine.add_request([1, 2, 3], GREEDY, on_piece=pieces.append)
    engine.step()
    engine.shutdown()
    assert pieces[-1].finish_reason == "abort" and engine.result(rid).finish_reason == "abort"
    assert all_blocks_free(engine)


def test_a_failing_forward_reaches_every_waiter(tiny_gpt2, monkeypatch):
    engine = Engine(tiny_gpt2, num_blocks=32, block_size=4)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.core.runner, "run", broken)

    async def main():
        with pytest.raises(RuntimeError, match="engine failed") as e:
            await collect(engine.stream([1, 2, 3], GREEDY))
        assert "boom" in repr(e.value.__cause__)

    asyncio.run(main())
    with pytest.raises(RuntimeError, match="stopped after an error: RuntimeError\\('boom'\\)"):
        engine.add_request([1], GREEDY)
    assert all_blocks_free(engine)
    engine._thread.join(timeout=10)
    assert not engine._thread.is_alive()  # the loop ended; it does not spin


def test_the_thread_lets_a_stream_take_each_step_before_the_next(tiny_gpt2, monkeypatch):
    """After a step that fed a stream, the stepping thread waits for the stream's reader to take
    the piece before it starts the next step (frontends.READER_WAIT_S; a long wait here so that a
    slow test machine cannot time it out): every piece arrives while its own step is the last
    one run, and the tokens are generate()'s."""
    monkeypatch.setattr(frontends, "READER_WAIT_S", 30.0)
    prompt = ragged_prompts(96, seed=11)[3]

    async def main(engine):
        pieces, steps = [], []
        async for piece in engine.stream(prompt, GREEDY):
            pieces.append(piece)
            steps.append(engine.core.counts["steps"])
            await asyncio.sleep(0.01)  # a slow reader: the engine waits for it, step after step
        return pieces, steps

    with Engine(tiny_gpt2, num_blocks=96, block_size=4) as engine:
        pieces, steps = asyncio.run(main(engine))
    assert steps == list(range(steps[0], steps[0] + len(pieces)))  # one step per piece, none ahead
    assert [t for x in pieces for t in x.token_ids] == reference(tiny_gpt2, prompt, GREEDY)[0].token_ids


class _CountingEvent:
    """A stream's reader_idle event, with the stepping thread's waits on it counted."""

    def __init__(self, event):
        self.event, self.waits = event, []

    def is_set(self):
        return self.event.is_set()

    def wait(self, timeout):
        self.waits.append(self.event.wait(timeout))
        return self.waits[-1]


def test_a_stream_that_stops_reading_is_skipped_until_it_catches_up(tiny_gpt2, monkeypatch):
    """A reader that stops taking its pieces (a client that stopped reading) costs one timed-out
    wait, not one per step: while it is behind the engine steps on without waiting for it; once
    it reads again and has caught up it is waited for again; both streams get generate()'s tokens."""
    monkeypatch.setattr(frontends, "READER_WAIT_S", 0.2)
    prompts = ragged_prompts(96, seed=12)
    seen = {}

    async def main(engine):
        async def stalled():
            agen = engine.stream(prompts[4], LONG, request_id="stalled")
            first = await anext(agen)
            group = engine._groups["stalled"]
            seen["idle"] = group.reader_idle = _CountingEvent(group.reader_idle)
            while engine.core.counts["steps"] < 20:  # not reading while the engine steps on
                await asyncio.sleep(0.01)
            seen["stalled_waits"] = list(seen["idle"].waits)
            pieces = [first]
            async for piece in agen:  # reading again: the queued pieces at once, then the paced one's pace
                pieces.append(piece)
                if len(pieces) == group.handed:
                    # caught up: it takes each new piece 20 ms after it came, so the engine, which
                    # waits for it again, finds it not idle yet (a reader that took it at once could
                    # beat the engine to its check, which then had nothing to wait for)
                    await asyncio.sleep(0.02)
            return pieces

        async def paced():
            # once the stalled reader reads again, the engine steps at this reader's pace (it waits
            # for it): the stalled one catches up with steps still to come, however loaded the machine
            pieces = []
            async for piece in engine.stream(prompts[5], LONG):
                pieces.append(piece)
                if engine.core.counts["steps"] >= 20:
                    await asyncio.sleep(0.02)
            return pieces

        return await asyncio.gather(stalled(), paced())

    with Engine(tiny_gpt2, num_blocks=96, block_size=4) as engine:
        slow, other = asyncio.run(main(engine))
    assert seen["stalled_waits"].count(False) <= 1  # at most one wait timed out, none while it was behind
    assert True in seen["idle"].waits[1:]  # reading again, it is waited for (and takes its pieces)
    assert [t for x in slow for t in x.token_ids] == reference(tiny_gpt2, prompts[4], LONG)[0].token_ids
    assert [t for x in other for t in x.token_ids] == reference(tiny_gpt2, prompts[5], LONG)[0].token_ids


def test_a_direct_consumer_gets_pieces_only_while_the_reader_has_caught_up(tiny):
    """Engine.stream(direct=...): a piece goes to `direct` (in the stepping thread) only when the
    reader has passed every earlier piece through its consumer; refused pieces and the last one
    reach the reader. Together, in arrival order, they are the whole completion, as generate()'s."""
    prompts = ragged_prompts(tiny.config.vocab_size, seed=11)[:3]
    arrivals, offers = [], []

    async def main(engine):
        async def one(k, p):
            calls = 0

            def direct(piece):
                nonlocal calls
                calls += 1
                offers.append((k, calls))
                if calls % 3 == 0:
                    return False  # refused: the reader gets it
                arrivals.append((k, "direct", piece))
                return True

            async for piece in engine.stream(p, LONG, direct=direct):
                arrivals.append((k, "reader", piece))
                await asyncio.sleep(0.003 * (k + 1))  # a consumer slower than a step, at times

        await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts)))

    with Engine(tiny, num_blocks=96, block_size=4, max_num_seqs=4) as engine:
        asyncio.run(main(engine))
    for k, p in enumerate(prompts):
        mine = [(how, x) for kk, how, x in arrivals if kk == k]
        ref = reference(tiny, p, LONG)[0]
        assert [t for _, x in mine for t in x.token_ids] == ref.token_ids  # every token once, in order
        assert [x.num_output_tokens for _, x in mine] == list(range(1, len(ref.token_ids) + 1))
        assert mine[-1][0] == "reader" and mine[-1][1].finish_reason == ref.finish_reason
        assert any(how == "direct" for how, _ in mine) and any(how == "reader" for how, _ in mine[1:-1])
    assert all(x.finish_reason is None for _, how, x in arrivals if how == "direct")
    assert all_blocks_free(engine)
