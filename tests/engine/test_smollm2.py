"""The engine on the real SmolLM2-135M-Instruct (GQA 9:3, 30 layers), against headwise.generate
run one prompt at a time: 12 prompts of different lengths, six chats sharing a long system
prompt, then a second batch that finds that prompt in the prefix table; and a stream with a
stop string. Token counts stay small: 2 shared cores."""

import asyncio

import pytest

import headwise
from headwise import Engine, SamplingParams

from .conftest import all_blocks_free, reference

SYSTEM = (
    "You are a careful assistant for a museum. You answer visitors' questions about history, "
    "geography and science in one or two short sentences, and you never make up facts."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three planets.",
    "Who wrote Hamlet?",
    "What is photosynthesis?",
    "How tall is Mount Everest?",
    "What do bees make?",
    "Where is the Nile?",
]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def chat(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def smol(smollm2_fp32):
    # fp32 (the file dequantized): the engine's chunked, batched and paged steps must give exactly
    # generate()'s tokens, which holds where each row's arithmetic is fp32 throughout. The default's
    # int8 activations turn fp32 rounding differences between those paths (~1e-6) into whole
    # rounding steps now and then, so greedy runs may fork where generate() itself has a near-tie
    # (tests/models/test_load_weights.py measures that default's quality against fp32).
    return smollm2_fp32  # the session's: headwise.load("smollm2-135m-instruct", weights="fp32")


def test_greedy_equals_generate_then_prefix_hits(smol):
    plain = [
        "Once upon a time",
        "def fibonacci(n):",
        "The quick brown fox jumps over",
        "1, 2, 3, 4,",
        "In 1492, Columbus sailed",
        "Hello",
    ]
    prompts = [chat(q) for q in QUESTIONS[:6]] + plain
    # a 96-token budget splits the ~60-token chats into chunks that share steps with decodes
    engine = Engine(smol, max_num_seqs=12, max_num_batched_tokens=96, num_blocks=256)
    outs = engine.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        ref = reference(smol, p, GREEDY)[0]
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert all_blocks_free(engine)

    system_blocks = (
        len(
            smol.tokenizer.encode(
                smol.tokenizer.apply_chat_template(
                    [{"role": "system", "content": SYSTEM}], add_generation_prompt=False
                ),
                add_special_tokens=False,
            )
        )
        // 16
    )
    assert system_blocks >= 2
    before = engine.stats().prefix_cache_hits
    second = [chat(q) for q in QUESTIONS[6:]] + prompts[:2]
    outs = engine.generate(second, GREEDY)
    for p, out in zip(second, outs):
        ref = reference(smol, p, GREEDY)[0]
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert out.num_cached_tokens >= system_blocks * 16
    assert engine.stats().prefix_cache_hits - before >= 4 * system_blocks * 16
    assert all_blocks_free(engine)


def test_stream_holds_back_stop_strings_and_never_splits_text(smol):
    params = SamplingParams(max_new_tokens=16, temperature=0, stop=[" is"])
    prompt = chat(QUESTIONS[0])
    ref = reference(smol, prompt, params)[0]

    async def main(engine):
        return [p async for p in engine.stream(prompt, params)]

    with Engine(smol, max_num_seqs=4, num_blocks=64) as engine:
        pieces = asyncio.run(main(engine))
    assert "".join(p.text for p in pieces) == ref.text
    assert [t for p in pieces for t in p.token_ids] == ref.token_ids
    assert pieces[-1].finish_reason == ref.finish_reason == "stop"
    assert all(" is" not in p.text and "\ufffd" not in p.text for p in pieces)


def test_stop_string_on_the_last_allowed_token_is_a_stop(smol):
    """The core ends a request at max_new_tokens ("length") before the text is looked at; a stop
    string completed by that same token still makes it "stop", as in generate()."""
    prompt = chat(QUESTIONS[1])
    eight = headwise.generate(smol, prompt, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    seven = headwise.generate(smol, prompt, SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True))
    last = eight.text[len(seven.text) :].strip()
    assert last and last not in seven.text  # the 8th token's text, new
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, stop=[last])
    ref = headwise.generate(smol, prompt, params)
    assert ref.finish_reason == "stop" and len(ref.token_ids) == 8
    out = Engine(smol, max_num_seqs=2, num_blocks=64).generate([prompt], params)[0]
    assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, "stop")


def test_stats_report_weight_bytes_per_format_as_the_file_stores_them():
    """The default load computes from the GGUF's blocks: stats() prices the weights per format,
    and the figures equal the file's own tensor bytes per GGML type (gguf's reader)."""
    import gguf

    from headwise.models.builtin import resolve

    path = resolve("smollm2-135m-instruct")
    want: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        name = {"F32": "float32"}.get(t.tensor_type.name, t.tensor_type.name.lower())
        want[name] = want.get(name, 0) + int(t.n_bytes)
    engine = Engine(headwise.load(path), max_num_seqs=2, num_blocks=8)
    assert engine.stats().weight_bytes == want
    assert engine.stats().as_dict()["weight_bytes"] == want
