"""Byte-level BPE pieces for GGUF vocabularies: llama.cpp's pre-tokenizer splits and GPT-2's byte alphabet.

`Tokenizer.from_gguf_vocab` builds its `tokenizers` backend from these.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# llama.cpp's `tokenizer.ggml.pre` -> how its merges were learned to be split.
# GPT-2's ByteLevel regex is the default; SmolLM/StarCoder additionally split
# every digit on its own (their tokenizer.json: Digits(individual_digits=True)
# before ByteLevel; llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM does the same).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in (None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {
        "llama3": _LLAMA3_SPLIT,
        "llama-bpe": _LLAMA3_SPLIT,
        "llama-v3": _LLAMA3_SPLIT,
        "qwen2": _QWEN2_SPLIT,
        "deepseek-r1-qwen": _QWEN2_SPLIT,
    }.get(pre)
    if split is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not known here; known: gpt2, smollm, starcoder, "
            "llama3, llama-bpe, qwen2 and their aliases. Add its split regex to "
            "headwise/models/byte_level.py (llama.cpp's llama-vocab.cpp lists them)."
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def gpt2_bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte -> printable char map (the ByteLevel alphabet): printable bytes stand
    for themselves, the rest are shifted past U+0100 (openai/gpt-2 encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
