"""Text for head analysis that needs no download.

The default corpus is the English prose in Python's own documentation, shipped with
every CPython as `pydoc_data.topics` (the Language Reference sections `help()` shows):
~80 topics, ~460k characters. Grammar blocks, code samples and lists are left out;
what stays is paragraphs of running text. Topics are split in two by position in
sorted order, so text used to fit anything (importance, mean ablation, role scores)
never overlaps the held-out text the ablation curves are measured on.

A user corpus (`--corpus FILE`) is plain text, paragraphs separated by blank lines,
split the same way (alternate paragraphs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")


@dataclass
class Corpus:
    """Paragraphs (for language-model loss) and sentences (for embeddings), in two halves."""

    source: str
    fit_paragraphs: list[str]  # importance, mean ablation, roles
    heldout_paragraphs: list[str]  # ablation curves, pruning quality

    @property
    def fit_sentences(self) -> list[str]:
        return sentences(self.fit_paragraphs)

    @property
    def heldout_sentences(self) -> list[str]:
        return sentences(self.heldout_paragraphs)


def is_prose(paragraph: str) -> bool:
    """Running text: starts with a capital, mostly letters and spaces, no grammar/code marks."""
    if len(paragraph) < 120 or not paragraph[0].isupper() or paragraph.endswith(":"):
        return False
    if any(mark in paragraph for mark in ("::=", ">>>", "***", "===", "---")):
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) > 0.88


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, unwrapped; indented blocks (code, grammar, lists) dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines or lines[0][:1].isspace() or lines[0].lstrip()[:2] in ("* ", "- ", "+ "):
            continue
        para = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(" ".join(lines).split()))  # re-join "non- negative"
        if is_prose(para):
            out.append(para)
    return out


def sentences(paras: list[str], min_words: int = 6, max_words: int = 40) -> list[str]:
    out = []
    for p in paras:
        for s in _SENTENCE_END.split(p):
            n = len(s.split())
            if min_words <= n <= max_words and s[-1:] in ".!?":
                out.append(s)
    return out


def pydoc_corpus() -> Corpus:
    from pydoc_data.topics import topics

    fit, held = [], []
    for i, name in enumerate(sorted(topics)):
        (held if i % 2 else fit).extend(paragraphs(topics[name]))
    return Corpus("pydoc_data.topics (Python's Language Reference, English prose)", fit, held)


def file_corpus(path: str | Path) -> Corpus:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--corpus {path}: cannot read it as UTF-8 text: {e}") from None
    paras = [" ".join(b.split()) for b in re.split(r"\n\s*\n", text) if b.strip()]
    if len(paras) < 2:
        raise ValueError(
            f"--corpus {path}: needs at least 2 paragraphs separated by a blank line "
            f"(one half fits importance, the other is held out); found {len(paras)}"
        )
    return Corpus(str(path), paras[0::2], paras[1::2])


def load_corpus(path: str | Path | None = None) -> Corpus:
    return pydoc_corpus() if path is None else file_corpus(path)
