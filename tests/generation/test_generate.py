"""headwise.generate against transformers' generate with the same weights, plus
batching, streaming, stop strings, seeds and bad input."""

import pytest
import torch

import headwise
import transformers as tf  # the independent reference

from headwise.models.builtin import resolve
from headwise.models.gguf import read_gguf

from ..helpers import save_hf, tiny_llama_config

tf.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random GQA Llama saved offline, loaded by both libraries."""
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tiny_llama_config()).eval()
    return hf, headwise.load(save_hf(tmp_path_factory, "tiny", hf))


@pytest.fixture(scope="module")
def smol(smollm2_fp32):
    """SmolLM2-135M-Instruct from the packaged GGUF: headwise's model, and transformers'
    LlamaForCausalLM holding the same dequantized tensors (tests/models checks those
    tensors equal what transformers reads from the file). weights="fp32": the file dequantized, as
    transformers runs it (the default computes from the blocks as stored: tests/models/test_load_weights.py)."""
    model = smollm2_fp32  # the session's: headwise.load("smollm2-135m-instruct", weights="fp32")
    hf_config, tensors, _ = read_gguf(resolve("smollm2-135m-instruct"))
    config = tf.LlamaConfig(**{k: v for k, v in hf_config.items() if k not in ("gguf", "_name_or_path")})
    hf = tf.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return model, hf


@torch.no_grad()
def _hf_greedy(hf, ids, n):
    """n argmax steps with transformers' forward and its own KV cache (EOS not special)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)  # deprecated name, still works in 5.x
    return tokens


def test_greedy_ids_match_transformers(tiny):
    hf, model = tiny
    prompt = list(range(3, 20))
    res = headwise.generate(model, prompt, max_new_tokens=32, temperature=0)
    assert res.token_ids == _hf_greedy(hf, prompt, 32)
    assert res.finish_reason == "length" and res.prompt_token_ids == prompt


def test_batched_prompts_of_different_lengths_equal_one_at_a_time(tiny):
    _, model = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 1, 30)]
    batched = headwise.generate(model, prompts, max_new_tokens=20, temperature=0)
    for p, r in zip(prompts, batched):
        assert r.token_ids == headwise.generate(model, p, max_new_tokens=20, temperature=0).token_ids


@torch.no_grad()
def test_prefill_computes_the_output_layer_for_each_prompt_last_row_only(tiny):
    """A counting hook on lm_head: the ragged prefill of 4 prompts (up to 30 tokens) sends 4 rows
    through the output layer, not 4 x 30; each decode step sends 4. The ids still equal HF's."""
    hf, model = tiny
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 30, 1, 12)]
    rows = []
    handle = model.lm_head.register_forward_hook(
        lambda mod, args, out: rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    try:
        res = headwise.generate(model, prompts, max_new_tokens=6, temperature=0)
    finally:
        handle.remove()
    assert rows == [4] * 6  # the prefill, then 5 decode steps (the 6th token is the last)
    for p, r in zip(prompts, res):
        assert r.token_ids == _hf_greedy(hf, p, 6)


def test_seeded_sampling_reproduces(tiny):
    _, model = tiny
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95)
    a = headwise.generate(model, [1, 2, 3], seed=7, **kw).token_ids
    assert a == headwise.generate(model, [1, 2, 3], seed=7, **kw).token_ids
    assert a != headwise.generate(model, [1, 2, 3], seed=8, **kw).token_ids


def test_smollm2_logits_and_greedy_64_match_transformers(smol):
    model, hf = smol
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = model.tokenizer.encode(
        model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
    )
    with torch.no_grad():
        assert (model(torch.tensor([ids])) - hf(torch.tensor([ids])).logits).abs().max() <= 1e-3
    res = headwise.generate(model, msgs, max_new_tokens=64, temperature=0, ignore_eos=True)
    assert res.token_ids == _hf_greedy(hf, ids, 64)
    assert "Paris" in res.text


def test_streaming_pieces_join_to_the_text_and_never_split_utf8(smol):
    model, _ = smol
    msgs = [{"role": "user", "content": "Write three emoji and the word 'café' in Japanese."}]
    full = headwise.generate(model, msgs, max_new_tokens=40, temperature=0)
    pieces = list(headwise.generate(model, msgs, max_new_tokens=40, temperature=0, stream=True))
    assert "".join(pieces) == full.text
    assert len(pieces) > 5 and len(full.token_ids) > len(pieces)  # multi-token characters were held back
    # every piece is whole characters; only the final flush may end in a character cut by max_new_tokens
    assert all("\ufffd" not in p for p in pieces[:-1])


def test_a_stream_sees_the_model_changed_between_its_pieces(smol):
    """A stream takes the model as it is at each step: a hook added between two pieces runs at
    every later step and changes the text from there on, as it changes a whole generate()."""
    model, _ = smol
    prompt = [{"role": "user", "content": "Name three rivers of Europe."}]
    calls = []

    def flip(module, args, out):
        calls.append(out.shape)
        return out * -4.0

    stream = headwise.generate(model, prompt, max_new_tokens=16, temperature=0, ignore_eos=True, stream=True)
    head = next(stream) + next(stream) + next(stream)  # the stack remembered and run from the memo
    handle = model.layers[5].mlp.register_forward_hook(flip)
    try:
        tail = "".join(stream)
        whole = headwise.generate(model, prompt, max_new_tokens=16, temperature=0, ignore_eos=True)
    finally:
        handle.remove()
    plain = headwise.generate(model, prompt, max_new_tokens=16, temperature=0, ignore_eos=True)
    assert len(calls) >= 16  # the stream's later steps and every step of the whole run
    assert plain.text.startswith(head) and head + tail != plain.text  # the hook changed the rest
    assert whole.text != plain.text


def test_stop_strings_cut_across_token_boundaries(smol):
    model, _ = smol
    prompt = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]
    base = headwise.generate(model, prompt, max_new_tokens=48, temperature=0)
    tok = model.tokenizer
    # a stop string made of the end of one token and the start of the next
    pieces = [tok.decode(base.token_ids[:i]) for i in range(1, len(base.token_ids))]
    i = next(i for i in range(6, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    boundary = len(pieces[i - 1])
    stop = base.text[boundary - 2 : boundary + 2]
    expect = base.text[: base.text.find(stop)]
    res = headwise.generate(model, prompt, max_new_tokens=48, temperature=0, stop=[stop])
    assert res.finish_reason == "stop" and res.text == expect
    streamed = "".join(headwise.generate(model, prompt, max_new_tokens=48, temperature=0, stop=[stop], stream=True))
    assert streamed == expect


def test_eos_stops_generation(smol):
    model, _ = smol
    res = headwise.generate(model, [{"role": "user", "content": "Say hi."}], max_new_tokens=200, temperature=0)
    assert res.finish_reason == "stop" and res.token_ids[-1] in model.tokenizer.stop_token_ids


def test_bad_input(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        headwise.generate(model, [[]], max_new_tokens=4)
    with pytest.raises(
        ValueError,
        match="prompt 0 has 250 tokens; with max_new_tokens=10 that exceeds max_model_len=256 \\(the model's context of 256",
    ):
        headwise.generate(model, [1] * 250, max_new_tokens=10)
    with pytest.raises(ValueError, match="no tokenizer"):
        headwise.generate(model, "text", max_new_tokens=4)
    with pytest.raises(TypeError, match="unknown sampling field"):
        headwise.generate(model, [1, 2], max_tokens=4)


def test_tensor_prompts_one_or_a_batch(tiny):
    """A 1-D tensor is one prompt (as the same ids in a list); a 2-D tensor is a batch of rows."""
    hf, model = tiny
    ids = torch.arange(3, 15)
    one = headwise.generate(model, ids, max_new_tokens=8, temperature=0)
    assert one.token_ids == _hf_greedy(hf, ids.tolist(), 8)
    rows = headwise.generate(model, torch.stack([ids, ids + 20]), max_new_tokens=8, temperature=0)
    assert [r.token_ids for r in rows] == [_hf_greedy(hf, p, 8) for p in (ids.tolist(), (ids + 20).tolist())]
    with pytest.raises(ValueError, match="integer token ids"):
        headwise.generate(model, torch.rand(4), max_new_tokens=2)


def test_compiled_decode_matches_transformers_and_eager(tiny):
    """generate(compile=True): the decode step as one inductor graph (frozen weights, static
    cache) gives transformers' greedy tokens, for one prompt and a ragged batch."""
    hf, model = tiny
    prompt = list(range(3, 20))
    res = headwise.generate(model, prompt, max_new_tokens=24, temperature=0, compile=True)
    assert res.token_ids == _hf_greedy(hf, prompt, 24)
    prompts = [prompt, list(range(40, 45))]
    batched = headwise.generate(model, prompts, max_new_tokens=12, temperature=0, compile=True)
    eager = headwise.generate(model, prompts, max_new_tokens=12, temperature=0)
    assert [r.token_ids for r in batched] == [r.token_ids for r in eager]


@torch.inference_mode()
def test_an_int8_kv_cache_decodes_as_torch_attends_over_it(tiny, monkeypatch):
    """generate(kv_dtype="int8") keeps K/V in an int8 cache (its decode steps read them in the
    stack kernel) and picks the tokens that torch's math attention over the same int8 cache,
    stepped by the block's route, picks."""
    from headwise import cache as caches
    from headwise.models import executors

    _, model = tiny
    prompt = list(range(5, 40))
    made = []
    real = caches.ContiguousKVCache

    def spy(*args, **kw):
        made.append(kw.get("kv_dtype"))
        return real(*args, **kw)

    monkeypatch.setattr(caches, "ContiguousKVCache", spy)
    got = headwise.generate(model, prompt, max_new_tokens=24, temperature=0, kv_dtype="int8").token_ids
    assert made == ["int8"]
    monkeypatch.setattr(caches, "ContiguousKVCache", real)
    cfg = model.config
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executors, "STACK", False)  # blocks.fused_layer with the math backend: no C stack
        for layer in model.layers:
            mp.setattr(layer.attn, "backend", "math")
        cache = real(cfg.num_layers, 1, cfg.num_kv_heads, len(prompt) + 24, cfg.head_dim, kv_dtype="int8")
        nxt = model(torch.tensor([prompt]), cache=cache)[:, -1].argmax(-1, keepdim=True)
        want = [int(nxt)]
        for _ in range(23):
            nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)
            want.append(int(nxt))
    assert got == want


def test_a_bad_kv_dtype_is_named(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="kv_dtype must be None .* or 'int8', got 'fp8'"):
        headwise.generate(model, [1, 2, 3], max_new_tokens=2, kv_dtype="fp8")
    with pytest.raises(ValueError, match="does not combine with compile=True"):
        headwise.generate(model, [1, 2, 3], max_new_tokens=2, kv_dtype="int8", compile=True)
