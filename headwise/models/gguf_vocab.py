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
its merges were learned; its normal tokens' scores fall with position anyway).
"""

from __future__ import annotations

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
    _check_lengths(tokens, types=types)
    for i, m in enumerate(merges):
        if " " not in m:  # split at the first space below, as llama.cpp splits them
            raise ValueError(f"tokenizer.ggml.merges[{i}]={m[:80]!r} is not two tokens separated by a space")
    to_char = gpt2_bytes_to_chars()
    alphabet = set(to_char.values())
    spelled = [t if set(t) <= alphabet else "".join(to_char[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a merge of unknown tokens
        raise ValueError(f"tokenizer.ggml.merges do not fit the vocabulary: {' '.join(str(e).split())[:200]}") from None
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
    prefix_every_piece: bool = False,
):
    """-> (backend, spelled tokens) for a SentencePiece-BPE vocabulary (module docstring).

    A run of spaces stored as real spaces ("  ", Gemma's user-defined tokens) is spelled with "▁",
    as the normalized text has it. add_space_prefix: "hi" is read as "▁hi" (Llama 2), where Gemma
    says False. rank_by_position: merges ranked by vocabulary order instead of score.
    prefix_every_piece: the prefix space on every run of text between special tokens (Phi-3)."""
    _check_lengths(tokens, types=types, scores=scores)
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
    if prefix_every_piece and add_space_prefix:  # Phi-3: "▁" before every piece of text, even after a
        # special token and before a leading space, as llama.cpp does (transformers' phi3_tokenizer)
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:  # "first": as transformers' LlamaTokenizer; a text already starting with "▁" gets none
        scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * add_space_prefix)
    _add_typed_tokens(backend, tokens, types, keep=lambda i: spelled[i] == tokens[i])
    return backend, spelled


def _spm_merges(tokens: list[str], vocab: dict[str, int], score: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every token into two tokens, best merged token first; ties as
    transformers' generate_merges breaks them (longer left, longer right, vocabulary order).

    Gemma has 262k tokens and ~1.2 M split points; looking each half up in a dict from Python takes
    seconds, so the halves are looked up by hash in numpy instead (`_Substrings`): two independent
    64-bit polynomial hashes plus the length must all agree."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    text = _Substrings(tokens, lengths)
    own = text.find(text.starts, lengths)  # a token listed twice is looked up as its last id, as in vocab
    ids = np.nonzero((lengths > 1) & (own == np.arange(len(tokens))))[0]
    splits = lengths[ids] - 1
    owner = np.repeat(ids, splits)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(splits) - splits, splits) + 1  # 1 .. len - 1
    left = text.find(text.starts[owner], k)
    right = text.find(text.starts[owner] + k, lengths[owner] - k)
    hit = (left >= 0) & (right >= 0)
    left, right, owner, k = left[hit], right[hit], owner[hit], k[hit]
    # np.lexsort: the last key is the primary one
    order = np.lexsort((right, left, owner, -(lengths[owner] - k), -k, -score[owner]))
    at = tokens.__getitem__
    return list(zip(map(at, left[order].tolist()), map(at, right[order].tolist())))


class _Substrings:
    """Hashes of any substring of the concatenated tokens in O(1) numpy work each: with
    G[i] = sum_{j<i} c_j * B^-j (mod 2^64, B odd so invertible), the substring [a, a + n) hashes to
    B^(a+n-1) * (G[a+n] - G[a]) = sum c_j * B^(a+n-1-j), the same for equal strings anywhere."""

    BASES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)

    def __init__(self, tokens: Sequence[str], lengths: np.ndarray):
        self.lengths = lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        codes = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + 1
        self.tables = []
        with np.errstate(over="ignore"):
            for base in self.BASES:
                powers = self._powers(base, len(codes) + 1)  # B^i
                inverse = self._powers(pow(base, -1, 1 << 64), len(codes) + 1)  # B^-i
                g = np.concatenate([[np.uint64(0)], np.cumsum(codes * inverse[:-1], dtype=np.uint64)])
                self.tables.append((powers, g))
        whole = self.hashes(self.starts, lengths)
        keep = np.nonzero(lengths > 0)[0]
        order = np.argsort(whole[0][keep], kind="stable")  # equal strings: the last id sorts last
        self.ids, self.sorted = keep[order], whole[0][keep][order]
        self.whole = whole

    @staticmethod
    def _powers(base: int, n: int) -> np.ndarray:
        """base^0 .. base^(n-1) mod 2^64 (uint64 products wrap)."""
        return np.concatenate([[np.uint64(1)], np.cumprod(np.full(n - 1, base, dtype=np.uint64))])

    def hashes(self, start: np.ndarray, n: np.ndarray) -> list[np.ndarray]:
        end = start + n
        with np.errstate(over="ignore"):
            return [powers[np.maximum(end - 1, 0)] * (g[end] - g[start]) for powers, g in self.tables]

    def find(self, start: np.ndarray, n: np.ndarray) -> np.ndarray:
        """The id of the token equal to each substring [start, start + n), or -1."""
        first, second = self.hashes(start, n)
        pos = np.searchsorted(self.sorted, first, side="right") - 1
        found = self.ids[np.maximum(pos, 0)]
        same = (pos >= 0) & (self.whole[0][found] == first) & (self.whole[1][found] == second)
        return np.where(same & (self.lengths[found] == n), found, -1)


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


def _check_lengths(tokens: Sequence[str], **arrays) -> None:
    """A per-token array (token_type, scores) has one entry per token, or is absent: llama.cpp reads
    entry i for every token i (an untrusted file's shorter or longer array is refused here)."""
    for name, values in arrays.items():
        if values is not None and len(values) and len(values) != len(tokens):
            key = "token_type" if name == "types" else name
            raise ValueError(f"tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")


def _add_typed_tokens(backend: Backend, tokens: Sequence[str], types: Sequence[int], keep) -> None:
    """CONTROL tokens become special added tokens (matched whole, skipped when decoding with
    skip_special_tokens); USER_DEFINED ones plain added tokens, which llama.cpp also matches whole.
    keep(i): whether token i may be added as written."""
    picked = [(i, t) for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED) and keep(i)]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in picked if t == CONTROL]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in picked if t == USER_DEFINED])
