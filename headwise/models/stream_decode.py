"""Streaming detokenization: token ids in, text out as each character completes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class StreamDecoder:
    """Token ids in, text out, never splitting a character.

    A byte-level token can end mid-way through a UTF-8 character (emoji, CJK);
    decoding it alone gives U+FFFD. push() holds text back while the decoded tail
    ends in U+FFFD and releases it when the character completes. Only a short
    window of recent ids is re-decoded (the prefix/read offsets of HF's and
    vLLM's incremental detokenizers), so a push costs O(window), not O(length).
    "".join(pushes) + flush() == tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were emitted; decoded again only as context
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text ('' while a character is unfinished)."""
        self.ids.append(int(token_id))
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if text.endswith("\ufffd") or not text.startswith(done):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is held back (a stream that ends inside a character gives U+FFFD here)."""
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]
