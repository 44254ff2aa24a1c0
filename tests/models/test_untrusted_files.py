"""Untrusted model files: bad metadata, tensor offsets and chat templates each fail in one line.

The crafted files are small GGUFs written by the `gguf` package's own GGUFWriter, then changed the
way an attacker would (a metadata value, one tensor's stored offset). The reference for "the file
is really bad" is gguf's own GGUFReader, which accepts every one of them: the checks that refuse
them are ours. Each test is time-bound; the template ones are memory-bound too (tracemalloc's peak).
"""

import time
import tracemalloc

import gguf
import numpy as np
import pytest

import headwise
from headwise.models.chat_template import ChatTemplateError, render_chat_template
from headwise.models.gguf import GGUFError, read_gguf

C, H, HKV, D, FF, LAYERS = 64, 4, 2, 16, 128, 2
TOKENS = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
PLAIN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def write_model(path, meta=None, template=PLAIN, tokens=TOKENS, types=None, merges=()):
    """A 2-layer fp32 llama GGUF (C=64, GQA 4/2) with `meta` overriding its llama.* sizes."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    sizes = {
        "context_length": 128,
        "embedding_length": C,
        "block_count": LAYERS,
        "feed_forward_length": FF,
        "attention.head_count": H,
        "attention.head_count_kv": HKV,
    } | (meta or {})
    for key, value in sizes.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(list(merges))
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3) if types is None else types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(TOKENS), C))
    w.add_tensor("output_norm.weight", 1 + rand(C))
    for i in range(LAYERS):
        for name, shape in (
            ("attn_norm", (C,)),
            ("ffn_norm", (C,)),
            ("attn_q", (H * D, C)),
            ("attn_k", (HKV * D, C)),
            ("attn_v", (HKV * D, C)),
            ("attn_output", (C, H * D)),
            ("ffn_gate", (FF, C)),
            ("ffn_up", (FF, C)),
            ("ffn_down", (C, FF)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def set_offset(path, tensor: str, offset: int) -> None:
    """Overwrite the offset stored in `tensor`'s info (the last field of its entry)."""
    reader = gguf.GGUFReader(path)
    field = next(t.field for t in reader.tensors if t.name == tensor)
    at = field.offset + sum(int(p.nbytes) for p in field.parts[:-1])
    del reader
    data = bytearray(path.read_bytes())
    data[at : at + 8] = np.array([offset], "<u8").tobytes()
    path.write_bytes(bytes(data))


def stored_offset(path, tensor: str) -> int:
    return next(int(t.field.parts[-1][0]) for t in gguf.GGUFReader(path).tensors if t.name == tensor)


def refused(path, match: str) -> str:
    """read_gguf's GGUFError for `path`: one line, matching, in under 5 s."""
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as e:
        read_gguf(path, use_cache=False)
    assert time.perf_counter() - start < 5
    assert "\n" not in str(e.value) and path.name in str(e.value)
    return str(e.value)


def test_a_sound_file_loads_and_renders(tmp_path):
    """The control: the same writer's file with nothing changed passes every check."""
    path = write_model(tmp_path / "ok.gguf")
    config, tensors, tok = read_gguf(path, use_cache=False)
    assert config["num_hidden_layers"] == LAYERS and len(tensors) == 2 + 9 * LAYERS
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


@pytest.mark.parametrize("count", [4_000_000_000, 3, 1])
def test_block_count_must_match_the_layers_present(tmp_path, count):
    path = write_model(tmp_path / "blocks.gguf", {"block_count": count})
    assert gguf.GGUFReader(path).fields["llama.block_count"].parts[-1][0] == count  # gguf reads it as is
    message = refused(path, f"llama.block_count={count}")
    assert "2 layers (blk.0 .. blk.1)" in message


def test_four_billion_layers_never_reach_the_model(tmp_path):
    """headwise.load (what `headwise generate` calls) refuses before building anything."""
    path = write_model(tmp_path / "huge.gguf", {"block_count": 4_000_000_000})
    start = time.perf_counter()
    with pytest.raises(GGUFError, match="block_count=4000000000"):
        headwise.load(path)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "key", ["attention.head_count", "attention.head_count_kv", "embedding_length", "block_count", "context_length"]
)
def test_zero_sizes_name_their_key(tmp_path, key):
    path = write_model(tmp_path / "zero.gguf", {key: 0})
    refused(path, f"llama.{key}=0 must be a positive integer")


def test_a_layer_pattern_for_other_layers_is_refused():
    """Gemma 3's per-layer sliding-window flags: one per layer (the fixture has 6 layers)."""
    from pathlib import Path

    from headwise.models.gguf import gguf_config, open_gguf
    from headwise.models.gguf_meta import read_metadata

    path = Path(__file__).parents[1] / "fixtures" / "families" / "gemma3.gguf"
    reader = open_gguf(path)
    meta = read_metadata(reader)
    assert meta["gemma3.block_count"] == 6
    meta["gemma3.attention.sliding_window_pattern"] = [True, False, True]
    with pytest.raises(GGUFError, match="sliding_window_pattern has 3 entries for 6 layers"):
        gguf_config(reader, meta, path)


def test_a_wrapping_offset_is_refused(tmp_path):
    """2**64 - 32 added to the data start wraps, in gguf's uint64 sum, to a span inside the file."""
    path = write_model(tmp_path / "wrap.gguf")
    set_offset(path, "blk.1.ffn_down.weight", 2**64 - 32)
    with np.errstate(over="ignore"):
        reader = gguf.GGUFReader(path)  # the reference accepts it: its data view lies inside the file
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert t.data_offset + t.n_bytes <= path.stat().st_size and t.data.shape == (C, FF)
    refused(path, "tensor blk.1.ffn_down.weight .* needs bytes up to 184467440737095")


def test_misaligned_and_overlapping_offsets_are_refused(tmp_path):
    path = write_model(tmp_path / "odd.gguf")
    set_offset(path, "blk.0.attn_q.weight", stored_offset(path, "blk.0.attn_q.weight") + 4)
    refused(path, "tensor blk.0.attn_q.weight is stored at offset .* not a multiple of the file's alignment 32")
    path = write_model(tmp_path / "shared.gguf")
    set_offset(path, "blk.0.attn_k.weight", stored_offset(path, "blk.0.attn_q.weight"))
    refused(path, "tensors blk.0.attn_(q|k).weight and blk.0.attn_(k|q).weight share bytes")


@pytest.mark.parametrize(
    "vocab, match",
    [
        ({"types": [3] * 5}, "tokenizer.ggml.token_type has 5 entries for 29 tokens"),
        ({"tokens": TOKENS[:2], "types": [3] * 29}, "tokenizer.ggml.token_type has 29 entries for 2 tokens"),
        ({"merges": ["a b", "a"]}, r"tokenizer.ggml.merges\[1\]='a' is not two tokens separated by a space"),
        ({"merges": ["zz qq"]}, "tokenizer.ggml.merges do not fit the vocabulary: .* `zz` out of vocabulary"),
    ],
)
def test_a_vocabulary_that_disagrees_with_itself_is_refused(tmp_path, vocab, match):
    path = write_model(tmp_path / "vocab.gguf", **vocab)
    assert len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data) == len(vocab.get("tokens", TOKENS))
    refused(path, match)


# ---- chat templates -----------------------------------------------------------------------

# The findings of issue 43, and their neighbours: each must stop in one line, in time, in memory.
HOSTILE = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "repeat": "{{ 'a' * 9000000000 }}",
    "strftime": "{{ strftime_now('%c' * 4000000) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "concat-doubling": "{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 40 + "{{ s | length }}",
    "plus-doubling": "{% set s = [1, 2] %}" + "{% set s = s + s %}" * 40 + "{{ s | length }}",
    "many-strings": "{% set s = 'a' * 7000000 %}" + "".join(f"{{% set v{i} = s ~ 'x' %}}" for i in range(200)),
    "long-raise": "{{ raise_exception('no\\n' * 100000) }}",
    "syntax": "{% for %}",
    "deep-parse": "{% if 1 %}" * 5000 + "x" + "{% endif %}" * 5000,
    "huge-text": "{{ 1 }}" * 200_000,  # 1.4M characters: compiling it alone took ~5 s
}


# what allocates: measured by tracemalloc (which slows a loop's steps ~5x, so not the loops)
ALLOCATING = {"repeat", "strftime", "concat-doubling", "plus-doubling", "many-strings", "long-raise"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_in_one_line_within_budget(name):
    if name in ALLOCATING:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError) as e:
            render_chat_template(HOSTILE[name], [{"role": "user", "content": "hi"}], source="evil.gguf")
        seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert message.startswith("chat template of evil.gguf ") and "\n" not in message and len(message) < 500
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback to print
    assert seconds < 5, seconds
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_template_variables_of_a_hostile_template_is_empty():
    """The server reads a template's variables (tools or not) before rendering it: no exception there."""
    from headwise.models.chat_template import template_variables

    assert template_variables("{{ messages }}{{ tools }}") == {"messages", "tools"}
    assert template_variables(HOSTILE["deep-parse"]) == set() == template_variables(HOSTILE["huge-text"])


def test_a_files_template_names_the_file(tmp_path):
    path = write_model(tmp_path / "loops.gguf", template=HOSTILE["recursion"])
    _, _, tok = read_gguf(path, use_cache=False)
    with pytest.raises(ChatTemplateError, match=r"^chat template of loops\.gguf stopped: calls nested more than 64"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(tmp_path) not in tok.chat_template.source  # the name, not the server's path
