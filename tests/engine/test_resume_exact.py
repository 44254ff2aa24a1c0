"""Recomputed output is computed as it was first computed (issue 43): a completion resumed from its
ids (runtime.output.Resume, what a replica gets on failover) and a preempted request's recompute go on
exactly as the uninterrupted run, token for token, with SmolLM2's stored Q4_1 weights. There a prefill
chunk and a decode step round differently (logits ~0.5 apart), and computing a stream's own output as
a prefill took other greedy tokens at 34 of 60 seams (before: runtime/runner.py's decode-row passes).
The reference is the same engine's run without the seam."""

from __future__ import annotations

import asyncio

import pytest

import headwise
from headwise import SamplingParams
from headwise.engine import Engine
from headwise.runtime.output import Resume

PROMPTS = ["The harbour at dawn", "Write a poem about the sea."]
N = 40  # tokens of each run


@pytest.fixture(scope="module")
def q4():
    return headwise.load("smollm2-135m-instruct")  # the stored GGUF, Q4_1, as `headwise serve` runs it


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


async def resumed(engine, prompt: list[int], done: list[int], text_chars: int) -> tuple[list[int], str]:
    ids, text = [], ""
    async for piece in engine.stream(prompt, greedy(N - len(done)), resume=Resume(tuple(done), text_chars)):
        ids += piece.token_ids
        text += piece.text
    return ids, text


def test_a_resumed_greedy_stream_is_the_uninterrupted_one(q4):
    engine = Engine(q4, max_num_seqs=4)
    try:
        prompts = [engine.output.prompts(p)[0][0] for p in PROMPTS]
        refs = [o.outputs[0] for o in engine.generate(prompts, greedy(N))]  # batched, as a server runs them
        decode = q4.tokenizer.decode
        for seam in (3, 11, 19, 27, 35):

            async def all_at_once(seam=seam):
                return await asyncio.gather(
                    *(
                        resumed(engine, p, r.token_ids[:seam], len(decode(r.token_ids[:seam])))
                        for p, r in zip(prompts, refs)
                    )
                )

            for (ids, text), ref in zip(asyncio.run(all_at_once()), refs):
                assert ids == ref.token_ids[seam:], seam
                assert decode(ref.token_ids[:seam]) + text == ref.text
    finally:
        engine.shutdown()


def test_a_preempted_request_recomputes_its_output_exactly(q4):
    """Six 80-token completions in a pool too small for all of them: the newest are preempted and
    recompute prompt + output; each ends as it does with room to spare (before: one did not)."""
    prompts = [f"{p} Part {i}." for i, p in enumerate(PROMPTS * 3)]
    roomy = Engine(q4, max_num_seqs=6, num_blocks=128, block_size=16)
    tight = Engine(q4, max_num_seqs=6, num_blocks=20, block_size=16)  # 6 x (~12 + 80) tokens need 36 blocks
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, greedy(80))]
    got = tight.generate(prompts, greedy(80))
    assert tight.stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
