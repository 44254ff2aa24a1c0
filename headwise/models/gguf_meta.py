"""A GGUF file's metadata and its tokenizer, as gguf.py reads them: keys -> Python values (long
arrays only when asked for), `tokenizer.ggml.*` -> a headwise Tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .tokenizer import Tokenizer


class GGUFError(ValueError):
    """The file is not a GGUF headwise can read; the message names the file and the part."""


_BIG_ARRAY = 1024  # longer arrays (vocab, merges, token types) are read only when asked for


def read_metadata(reader) -> dict:
    """Every key -> Python value, except long arrays, which map to None (see `_strings`/`_numbers`)."""
    import gguf

    VT = gguf.GGUFValueType
    meta = {}
    for key, field in reader.fields.items():
        kind = field.types[0] if field.types else None
        if kind == VT.STRING:
            meta[key] = _text(field.parts[-1], key)
        elif kind == VT.ARRAY:
            if len(field.data) > _BIG_ARRAY:
                meta[key] = None
            elif field.types[-1] == VT.STRING:
                meta[key] = _strings(field, key)
            else:
                meta[key] = _numbers(field).tolist()
        elif field.parts:
            meta[key] = field.parts[-1][0].item()
    return meta


def _text(part: np.ndarray, what: str) -> str:
    try:
        return bytes(part).decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFError(f"metadata {what} is not valid UTF-8 ({e})") from None


def _strings(field, key: str) -> list[str]:
    # bytes() of each part: the parts are plain views into the file, so this is one pass (~20 ms / 49k)
    return [_text(field.parts[i], key) for i in field.data]


def _numbers(field) -> np.ndarray:
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)


def gguf_tokenizer(reader, meta: dict, path: Path) -> Tokenizer:
    """The tokenizer described by `tokenizer.ggml.*` and `tokenizer.chat_template`."""
    f = reader.fields
    if "tokenizer.ggml.tokens" not in f:
        raise GGUFError(f"{path} has no tokenizer.ggml.tokens; it carries no vocabulary")
    tokens = _strings(f["tokenizer.ggml.tokens"], "tokenizer.ggml.tokens")
    merges = _strings(f["tokenizer.ggml.merges"], "tokenizer.ggml.merges") if "tokenizer.ggml.merges" in f else []
    types = _numbers(f["tokenizer.ggml.token_type"]).tolist() if "tokenizer.ggml.token_type" in f else None
    scores = _numbers(f["tokenizer.ggml.scores"]) if "tokenizer.ggml.scores" in f else None

    names = meta.get("tokenizer.chat_templates") or []  # named templates beside the default ("tool_use")

    def flag(name):  # absent -> None: the tokenizer model's own default (llama.cpp's)
        value = meta.get(f"tokenizer.ggml.{name}")
        return None if value is None else bool(value)

    try:
        return Tokenizer.from_gguf_vocab(
            model=meta.get("tokenizer.ggml.model"),
            pre=meta.get("tokenizer.ggml.pre"),
            arch=meta.get("general.architecture"),
            tokens=tokens,
            merges=merges,
            token_types=types,
            scores=scores,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            sep_id=meta.get("tokenizer.ggml.seperator_token_id"),  # sic: llama.cpp's spelling
            cls_id=meta.get("tokenizer.ggml.cls_token_id"),
            add_bos=flag("add_bos_token"),
            add_eos=flag("add_eos_token"),
            add_sep=flag("add_sep_token"),
            add_space_prefix=flag("add_space_prefix"),
            chat_template=meta.get("tokenizer.chat_template"),
            chat_templates={
                n: meta[f"tokenizer.chat_template.{n}"] for n in names if f"tokenizer.chat_template.{n}" in meta
            },
            stop_ids=[i for k in ("eot", "eom") if (i := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None],
        )
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None
