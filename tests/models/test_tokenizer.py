"""Tokenizers against transformers' own, on the two packaged models.

SmolLM2: built from the GGUF's vocabulary/merges vs `AutoTokenizer(gguf_file=...)`.
MiniLM: tokenizer.json and the bare vocab.txt vs `AutoTokenizer(model_dir)`.
"""

import shutil

import pytest

from headwise.models.builtin import resolve
from headwise.models.gguf import open_gguf
from headwise.models.gguf_meta import gguf_tokenizer, read_metadata
from headwise.models.chat_template import ChatTemplateError
from headwise.models.stream_decode import StreamDecoder
from headwise.models.tokenizer import Tokenizer

from .conftest import transformers_gguf_memo

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  leading spaces",
    "trailing   ",
    "tabs\tand\nnewlines\n\n\nend",
    "It's we'll they're I'd you've",
    "café naïve Ωμέγα Ünïcödé façade",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 family",
    "你好，世界。日本語のテキスト 한국어",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 12345 3.14159 1,000,000 x2 v1.0",
    "https://example.com/a?b=c&d=e#frag",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]
# A run of spaces right before a digit. SmolLM2 splits every digit off before
# the GPT-2 regex (its tokenizer.json: Digits(individual_digits) + ByteLevel;
# llama.cpp's SMOLLM pre-tokenizer: "\p{N}" then the GPT-2 regex), so the spaces
# stay one run: "a   1" -> a ĠĠĠ 1. transformers' GGUF loader has no entry for
# pre="smollm" and uses plain ByteLevel, giving a ĠĠ Ġ1 -> a ĠĠ Ġ 1. We follow
# the model's own tokenizer; these strings are checked against that rule instead.
DIGIT_AFTER_SPACES = {
    "a   1": ["a", "ĠĠĠ", "1"],
    "x  22 y": ["x", "ĠĠ", "2", "2", "Ġy"],
    "1 2  3": ["1", "Ġ", "2", "ĠĠ", "3"],
}
CHAT = [
    [{"role": "user", "content": "What is 2+2? 🤔"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "日本語で?"},
    ],
]
STREAM_TEXTS = ["emoji 😀👍🏽🇫🇷 👨‍👩‍👧!", "你好，世界。日本語のテキスト", "mixed: café 🤖 数学 ∑ 𝔘𝔫𝔦"]


@pytest.fixture(scope="module")
def smol_path():
    return resolve("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol(smol_path):
    """Ours, straight from the GGUF's metadata (no weights, no cache)."""
    reader = open_gguf(smol_path)
    return gguf_tokenizer(reader, read_metadata(reader), smol_path)


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    from transformers import AutoTokenizer

    with transformers_gguf_memo():  # the file parsed once (test_gguf.py's reference reads it too)
        return AutoTokenizer.from_pretrained(smol_path.parent, gguf_file=smol_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_equal_transformers(smol, smol_hf, text):
    for special in (True, False):
        assert smol.encode(text, add_special_tokens=special) == smol_hf(text, add_special_tokens=special).input_ids, (
            text,
            special,
        )


@pytest.mark.parametrize("text,pieces", DIGIT_AFTER_SPACES.items())
def test_smollm2_splits_digits_like_llama_cpp(smol, text, pieces):
    assert [smol.id_to_token(i) for i in smol.encode(text)] == pieces
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_encode_batch(smol, smol_hf):
    assert smol.encode_batch(TEXTS) == [smol.encode(t) for t in TEXTS] == smol_hf(TEXTS).input_ids


def test_smollm2_decode_round_trips(smol, smol_hf):
    for text in TEXTS + list(DIGIT_AFTER_SPACES):
        ids = smol.encode(text)
        assert smol.decode(ids) == text == smol_hf.decode(ids)
        assert smol.decode(ids, skip_special_tokens=True) == smol_hf.decode(ids, skip_special_tokens=True)
    assert smol.decode(smol.encode("<|im_start|>user\nhi<|im_end|>"), skip_special_tokens=True) == "user\nhi"


def test_smollm2_special_tokens(smol, smol_hf):
    assert (
        (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id)
        == (smol_hf.bos_token_id, smol_hf.eos_token_id, smol_hf.pad_token_id)
        == (1, 2, 2)
    )
    assert smol.vocab_size == len(smol_hf) == 49152
    assert smol.stop_token_ids == {smol.token_to_id("<|im_end|>"), smol.token_to_id("<|endoftext|>")}
    assert smol.encode("<|im_end|>", add_special_tokens=False) == [2]  # specials stay whole


@pytest.mark.parametrize("messages", CHAT, ids=["default-system", "own-system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_equals_transformers(smol, smol_hf, messages, add_generation_prompt):
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = smol_hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    ids = smol_hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert smol.encode(ours, add_special_tokens=False) == list(ids)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_helpers_and_sandbox(smol):
    refuse = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        smol.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=refuse)
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        smol.apply_chat_template([], chat_template=escape)
    assert (
        smol.apply_chat_template([{"role": "user", "content": "é"}], chat_template="{{ messages | tojson }}")
        == '[{"role": "user", "content": "é"}]'
    )
    assert Tokenizer(smol.backend).chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(smol.backend).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_never_splits_a_character(smol, text):
    ids = smol.encode(text)
    stream = StreamDecoder(smol)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smol.decode(ids) == text
    assert "" in pieces[:-1]  # some token ended mid-character and was held back


def test_stream_decoder_cut_mid_character(smol):
    ids = smol.encode("ok 😀")
    partial = ids[:-1]  # stop inside the emoji's bytes
    assert smol.decode(partial).endswith("\ufffd")
    stream = StreamDecoder(smol)
    text = "".join(stream.push(i) for i in partial)
    assert "\ufffd" not in text and text.startswith("ok")
    rest = stream.flush()
    assert rest.endswith("\ufffd") and text + rest == smol.decode(partial)


def test_stream_decoder_skips_specials(smol):
    ids = smol.encode("<|im_start|>assistant\nHi 👋<|im_end|>")
    stream = StreamDecoder(smol, skip_special_tokens=True)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "assistant\nHi 👋"


def test_saved_tokenizer_reloads_identically(smol, tmp_path):
    smol.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    for text in TEXTS + list(DIGIT_AFTER_SPACES):
        assert again.encode(text) == smol.encode(text)
    assert again.chat_template == smol.chat_template
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (1, 2, 2)
    assert again.stop_token_ids == smol.stop_token_ids


# ---- MiniLM (WordPiece) ---------------------------------------------------------------

BERT_TEXTS = [
    "Hello, World!",
    "HELLO world hello",
    "Crème brûlée at the Café — naïve façade!",
    "Ünïcödé ÀÉÎÕÜ ß ø æ",
    "don't stop: (a) [b] {c} <d> \"quoted\" 'single' ... ?!",
    "e-mail: someone@example.com, url https://x.org/a_b",
    "中文字符 and 日本語 mixed",
    "emoji 😀 are [UNK] here",
    "tabs\tnew\nlines  multiple   spaces",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "[CLS] literal special [SEP] tokens [MASK]",
    "a " * 200,  # longer than tokenizer.json's pinned 128
]


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def minilm_hf(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module", params=["tokenizer.json", "vocab.txt"])
def minilm(request, minilm_dir, tmp_path_factory):
    if request.param == "tokenizer.json":
        return Tokenizer.from_dir(minilm_dir)
    bare = tmp_path_factory.mktemp("wordpiece")
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, bare / name)
    return Tokenizer.from_dir(bare)


@pytest.mark.parametrize("text", BERT_TEXTS)
def test_minilm_ids_equal_transformers(minilm, minilm_hf, text):
    for special in (True, False):
        assert (
            minilm.encode(text, add_special_tokens=special) == minilm_hf(text, add_special_tokens=special).input_ids
        ), (text, special)


def test_minilm_batch_decode_and_specials(minilm, minilm_hf):
    assert minilm.encode_batch(BERT_TEXTS) == minilm_hf(BERT_TEXTS).input_ids
    for text in BERT_TEXTS:
        ids = minilm.encode(text)
        assert minilm.decode(ids, skip_special_tokens=True) == minilm_hf.decode(ids, skip_special_tokens=True)
    assert minilm.pad_token_id == minilm_hf.pad_token_id == 0
    assert minilm.vocab_size == len(minilm_hf) == 30522
    assert minilm.token_to_id("[CLS]") == 101 and minilm.model_max_length == 512


def test_from_dir_without_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor vocab.txt"):
        Tokenizer.from_dir(tmp_path)


def test_gguf_vocab_respells_raw_text_tokens():
    """A token stored as raw text ("\n\n") instead of byte-level ("ĊĊ") must still be reachable."""
    from tokenizers import pre_tokenizers

    tokens = ["<|end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["\n\n"]
    tok = Tokenizer.from_gguf_vocab(model="gpt2", tokens=tokens, merges=["Ċ Ċ"], token_types=[3] + [1] * 257, eos_id=0)
    ids = tok.encode("a\n\n<|end|>")
    assert ids[1:] == [len(tokens) - 1, 0] and tok.decode(ids) == "a\n\n<|end|>"
    assert tok.eos_token_id == 0 and tok.stop_token_ids == {0}


def test_gguf_add_bos_flag(tmp_path):
    from tokenizers import pre_tokenizers

    tokens = ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer.from_gguf_vocab(
        model="gpt2", tokens=tokens, merges=[], token_types=[3, 3] + [1] * 256, bos_id=0, eos_id=1, add_bos=True
    )
    a = tok.token_to_id("a")
    assert tok.encode("a") == [0, a] and tok.encode("a", add_special_tokens=False) == [a]
    tok.save(tmp_path)
    assert Tokenizer.from_dir(tmp_path).encode("a") == [0, a]
