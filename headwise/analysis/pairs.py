"""Prompt pairs for activation patching: a clean prompt, a corrupted one of the same token
length, and for decoders the answer token and the wrong one (patching.py measures them).

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupted": "When Mary and John went to the store, Mary gave a drink to",
     "answer": " Mary", "wrong": " John"}

is one line of a `headwise analyze --pairs FILE` JSONL file; prompts may also be lists of
token ids and answers ids (a model without a tokenizer). The defaults below are the
seed's "bank" sentence and two classic pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .capture import Batch, from_ids, is_causal, token_texts


@dataclass(frozen=True)
class Pair:
    """A clean prompt and a corrupted one of the same token length; for decoders the single
    token the clean prompt should be followed by (answer) and the one the corrupted prompt
    points to (wrong). Texts, or token ids for a model without a tokenizer."""

    clean: str | tuple[int, ...]
    corrupted: str | tuple[int, ...]
    answer: str | int | None = None
    wrong: str | int | None = None


# Defaults, checked on SmolLM2-135M-Instruct's tokenizer: each pair's prompts have the same
# token count, every answer is one token, and the model prefers answer on the clean prompt
# and wrong on the corrupted one (logit differences +6.2/-5.3, +7.4/-5.8, +3.7/-1.6).
LM_PAIRS = (
    # indirect object identification (Wang et al. 2022): the name that is not repeated
    Pair(
        "When Mary and John went to the store, John gave a drink to",
        "When Mary and John went to the store, Mary gave a drink to",
        " Mary",
        " John",
    ),
    # factual recall
    Pair("The capital of France is", "The capital of Italy is", " Paris", " Rome"),
    # the seed's "bank" sentence: which bank the loan came from
    Pair(
        "The bank approved the loan after the river bank flooded. The loan came from the",
        "The bank approved the loan after the river bank flooded. The water came from the",
        " bank",
        " river",
    ),
)
# Encoders (MiniLM's WordPiece: 13 tokens each): the river sense of "bank" taken away
ENCODER_PAIRS = (
    Pair(
        "The bank approved the loan after the river bank flooded.",
        "The bank approved the loan after the city hall flooded.",
    ),
    Pair("She sat on the river bank and watched the water.", "She sat in the savings bank and counted the money."),
)


def default_pairs(model: nn.Module) -> list[Pair]:
    return list(LM_PAIRS if is_causal(model) else ENCODER_PAIRS)


def load_pairs(path: str | Path) -> list[Pair]:
    """Pairs from a JSONL file, one object a line: {"clean", "corrupted", "answer", "wrong"}
    (answer and wrong for decoders only; texts, or token ids as ints / lists of ints)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--pairs {path}: no such file")
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg}); one object a line") from None
        if not isinstance(obj, dict) or "clean" not in obj or "corrupted" not in obj:
            raise ValueError(f'{path}:{n}: needs an object with "clean" and "corrupted" (and "answer", "wrong")')
        unknown = sorted(set(obj) - {"clean", "corrupted", "answer", "wrong"})
        if unknown:
            raise ValueError(f"{path}:{n}: unknown keys {unknown}; keys: clean, corrupted, answer, wrong")
        for key in ("clean", "corrupted"):
            v = obj[key]
            if not (isinstance(v, str) or (isinstance(v, list) and all(_is_id(i) for i in v))):
                raise ValueError(f"{path}:{n}: {key} must be a text or a list of token ids, got {v!r:.60}")
        for key in ("answer", "wrong"):
            v = obj.get(key)
            if not (v is None or isinstance(v, str) or _is_id(v)):
                raise ValueError(f"{path}:{n}: {key} must be a text or one token id, got {v!r:.60}")
        ids = [tuple(v) if isinstance(v, list) else v for v in (obj["clean"], obj["corrupted"])]
        pairs.append(Pair(*ids, obj.get("answer"), obj.get("wrong")))
    if not pairs:
        raise ValueError(f"{path}: no pairs (one JSON object a line)")
    return pairs


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class Encoded:
    """A pair as token ids; answer/wrong are None for encoders."""

    clean: Tensor  # (T,) long
    corrupted: Tensor  # (T,) long
    answer: int | None
    wrong: int | None
    tokens: list[str]  # the clean prompt's tokens
    corrupted_tokens: list[str]

    def batch(self, which: str = "clean") -> Batch:
        return from_ids([getattr(self, which).tolist()])


def encode_pair(model: nn.Module, pair: Pair) -> Encoded:
    """Token ids of a pair, checked: same length, answers that are single known tokens."""
    tok = getattr(model, "tokenizer", None)
    V = model.config.vocab_size

    def prompt(x, name):
        if isinstance(x, str):
            if tok is None:
                raise ValueError(f"{type(model).__name__} has no tokenizer; give the {name} prompt as token ids")
            ids = tok.encode(x)
        else:
            ids = [int(i) for i in x]
        bad = [i for i in ids if not 0 <= i < V]
        if not ids or bad:
            raise ValueError(f"the {name} prompt {x!r:.80} has no tokens or ids outside [0, {V}): {bad[:5]}")
        return ids

    clean, corrupted = prompt(pair.clean, "clean"), prompt(pair.corrupted, "corrupted")
    if len(clean) != len(corrupted):
        raise ValueError(
            f"the clean prompt has {len(clean)} tokens and the corrupted one {len(corrupted)}; patching "
            f"swaps outputs position by position, so they must line up: {pair.clean!r:.60} vs {pair.corrupted!r:.60}"
        )
    answer = wrong = None
    if is_causal(model):
        answer, wrong = _answer_id(model, pair.answer, "answer"), _answer_id(model, pair.wrong, "wrong")
        if answer == wrong:
            raise ValueError(f"answer and wrong are the same token ({answer}); the logit difference would be 0")
    elif pair.answer is not None or pair.wrong is not None:
        raise ValueError("an encoder is measured by the cosine to the clean embedding; leave answer and wrong out")
    names = (lambda ids: token_texts(tok, ids)) if tok is not None else (lambda ids: [str(i) for i in ids])
    as_t = lambda ids: torch.tensor(ids, dtype=torch.long)  # noqa: E731
    return Encoded(as_t(clean), as_t(corrupted), answer, wrong, names(clean), names(corrupted))


def _answer_id(model: nn.Module, x, name: str) -> int:
    V, tok = model.config.vocab_size, getattr(model, "tokenizer", None)
    if x is None:
        raise ValueError(f"a decoder pair needs {name}=: the token whose logit is compared (e.g. ' Mary')")
    if isinstance(x, int):
        if not 0 <= x < V:
            raise ValueError(f"{name} token id {x} is outside the vocabulary [0, {V})")
        return x
    if tok is None:
        raise ValueError(f"{type(model).__name__} has no tokenizer; give {name} as a token id")
    ids = tok.encode(x, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{name} {x!r} is {len(ids)} tokens {token_texts(tok, ids)}; the metric compares one token's logit: "
            f"pick a single-token {name} (often with its leading space)"
        )
    if ids[0] == tok.unk_token_id:
        raise ValueError(f"{name} {x!r} is unknown to the tokenizer (it becomes {tok.unk_token!r})")
    return ids[0]
