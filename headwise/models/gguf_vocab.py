"""A GGUF's vocabulary as a `tokenizers` backend, one builder per `tokenizer.ggml.model`.

  "gpt2"  byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM): tokens in GPT-2's byte alphabet, the
          file's merges, the split regex its `tokenizer.ggml.pre` names (byte_level.py).
  "llama" SentencePiece BPE (Llama 2, Gemma): tokens spelled with "▁" for a space, a score per
          token and no merges; unknown characters fall back to the <0xNN> byte tokens.
  "bert"  WordPiece (BERT): llama.cpp's converter writes word-initial pieces as "▁piece" and
          continuations bare, where vocab.txt has "piece" and "##piece"; we spell them back.

llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm) merges, again and again, the adjacent
pair whose concatenation is the best-scored token. That is BPE with a merge (l, r) for every
split of every token, ranked by the merged token's score, which is how transformers rebuilds
these files (integrations/gguf/gguf_tokenizer_mapping.py: generate_merges); we rank the same
way so ids equal theirs. Gemma's files rank by position in the vocabulary instead (the order
its merges were learned; its scores equal -position for every normal token anyway).
"""

from __future__ import annotations

from itertools import compress
from typing import Sequence

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from .byte_level import byte_level_pre_tokenizer, gpt2_bytes_to_chars

# llama.cpp's token types (llama-vocab.h, gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁": SentencePiece's visible space


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str | None):
    """-> (backend, spelled tokens). A token stored as raw text ("\\n\\n", "<｜end▁of▁sentence｜>")
    instead of in the ByteLevel alphabet could never come out of BPE: spell it the byte-level way
    (as transformers' GGUF loader does) and mark only tokens that need no respelling as added."""
    to_char = gpt2_bytes_to_chars()
    alphabet = set(to_char.values())
    spelled = [t if set(t) <= alphabet else "".join(to_char[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, types, keep=lambda i: spelled[i] == tokens[i])
    return backend, spelled


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    types: Sequence[int],
    *,
    unk: str | None,
    add_space_prefix: bool,
    rank_by_position: bool = False,
):
    """-> (backend, spelled tokens) for a SentencePiece-BPE vocabulary (module docstring).

    A run of spaces stored as real spaces ("  ", Gemma's user-defined tokens) is spelled with "▁",
    as the normalized text has it. add_space_prefix: "hi" is read as "▁hi" (Llama 2), where Gemma
    says False. rank_by_position: merges ranked by vocabulary order instead of score."""
    spelled = list(tokens)
    known = set(tokens)
    for i, t in enumerate(tokens):
        if t and " " in t and not t.strip() and (s := SPACE * len(t)) not in known:
            spelled[i] = s
    vocab = {t: i for i, t in enumerate(spelled)}
    if rank_by_position or scores is None:
        score = -np.arange(len(spelled), dtype=np.float64)
    else:
        score = np.asarray(scores, dtype=np.float64)
    merges = _spm_merges(spelled, vocab, score)
    unk = unk if unk in vocab else None
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    scheme = "first" if add_space_prefix else "never"  # "first": as transformers' LlamaTokenizer
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * add_space_prefix)
    _add_typed_tokens(backend, tokens, types, keep=lambda i: spelled[i] == tokens[i])
    return backend, spelled


def _spm_merges(tokens: list[str], vocab: dict[str, int], score: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every token into two tokens, best merged token first; ties as
    transformers' generate_merges breaks them (longer left, longer right, vocabulary order).

    Walked by split position k over the tokens still longer than k, as list comprehensions:
    ~1.5 M prefix look-ups for Gemma's 262k tokens."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    ids = np.nonzero(lengths > 1)[0]
    if len(vocab) < len(tokens):  # a token listed twice: its last id is the one in vocab
        ids = np.asarray([i for i in ids.tolist() if vocab[tokens[i]] == i], dtype=np.int64)
    ids = ids[np.argsort(-lengths[ids], kind="stable")]  # longest first: tokens longer than k lead
    strs = [tokens[i] for i in ids.tolist()]
    ids_list = ids.tolist()
    ends = np.searchsorted(-lengths[ids], -np.arange(int(lengths.max(initial=1)) + 1), side="left")
    get = {t: i + 1 for t, i in vocab.items()}.get  # id + 1, so a miss (0) is falsy for compress
    lefts: list[int] = []
    rights: list[int] = []
    owners: list[int] = []
    ks: list[int] = []
    for k in range(1, len(ends)):
        n = int(ends[k])  # tokens longer than k
        if n == 0:
            break
        heads = [get(t[:k], 0) for t in strs[:n]]
        hit = list(compress(strs[:n], heads))
        tails = [get(t[k:], 0) for t in hit]
        lefts += compress(compress(heads, heads), tails)
        rights += compress(tails, tails)
        owners += compress(compress(ids_list[:n], heads), tails)
        ks += [k] * (len(lefts) - len(ks))
    left, right = np.asarray(lefts, dtype=np.int64) - 1, np.asarray(rights, dtype=np.int64) - 1
    owner, k_ = np.asarray(owners, dtype=np.int64), np.asarray(ks, dtype=np.int64)
    # np.lexsort: the last key is the primary one
    order = np.lexsort((right, left, owner, -(lengths[owner] - k_), -k_, -score[owner]))
    at = tokens.__getitem__
    return list(zip(map(at, left[order].tolist()), map(at, right[order].tolist())))


def wordpiece(tokens: Sequence[str], types: Sequence[int], *, unk_id: int | None):
    """-> (backend, vocab.txt spelling) for llama.cpp's BERT vocabulary: "▁word" -> "word",
    "piece" -> "##piece", "[CLS]"-style tokens unchanged. Lower-cased, accents stripped and split
    on punctuation and CJK as llama.cpp's WPM tokenizer (llm_tokenizer_wpm) does: BERT uncased."""

    def spell(t: str) -> str:
        if t.startswith(SPACE):
            return t[1:]
        return t if t.startswith("[") and t.endswith("]") else "##" + t

    spelled = [spell(t) for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)
    unk = spelled[unk_id] if unk_id is not None and 0 <= unk_id < len(spelled) else "[UNK]"
    if unk not in vocab:
        raise ValueError("a WordPiece vocabulary needs an unknown token ([UNK] or tokenizer.ggml.unknown_token_id)")
    backend = Backend(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    _add_typed_tokens(backend, spelled, types, keep=lambda i: True)
    return backend, spelled


def _add_typed_tokens(backend: Backend, tokens: Sequence[str], types: Sequence[int], keep) -> None:
    """CONTROL tokens become special added tokens (matched whole, skipped when decoding with
    skip_special_tokens); USER_DEFINED ones plain added tokens, which llama.cpp also matches whole.
    keep(i): whether token i may be added as written."""
    picked = [(i, t) for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED) and keep(i)]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in picked if t == CONTROL]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in picked if t == USER_DEFINED])
