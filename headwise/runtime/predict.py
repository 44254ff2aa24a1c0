"""Predicted Outputs: a request says what it expects its output to be (OpenAI's `prediction`, e.g.
the file being edited), and the engine verifies that text instead of generating it token by token.

Each decode step of such a request drafts the next tokens of the prediction after its last token
and computes them in the same forward (one chunk of 1 + k tokens: the scheduler's `Chunk.draft`).
The core then samples the chunk's rows in order, each with the request's own sampling state,
appending each token, and stops at the first that differs from the draft (core.py): the output
is what sampling one token at a time would have drawn, exactly, for greedy and for sampling (a
row's token is drawn from the model's distribution at that point whatever the draft says; the
draft only decides how many rows were computed ahead). The K/V of the rejected rows is dropped
(`PagedKVCache.truncate`).

Where the prediction is: `pos`, the index of the next expected token. While the output follows
the prediction, the draft is `ids[pos : pos + size]`, and `size` doubles after a draft accepted
whole (up to `most`), falls back after a miss. Once the output leaves the prediction (the edit
itself), nothing is drafted until its last `ngram` tokens occur in the prediction again: the
output rejoined the text (the unchanged rest of the file), and drafting resumes there.
"""

from __future__ import annotations

from collections import defaultdict

MAX_PREDICTION_TOKENS = 32768  # what a request may carry; the n-gram index is built once per request


class Prediction:
    """The draft state of one completion (a `Request.prediction`)."""

    def __init__(self, ids, *, first: int = 4, most: int = 32, ngram: int = 3):
        self.ids = tuple(int(t) for t in ids)
        self.first, self.most, self.ngram = first, most, ngram
        self.pos, self.synced, self.size = 0, True, first
        # OpenAI's usage: output tokens that followed the prediction / draft tokens computed and dropped
        self.accepted = self.rejected = 0
        self._recent: list[int] = []  # the output's last `ngram` tokens
        self._after: dict[tuple, list[int]] | None = None  # n-gram -> positions after it (built on first miss)

    def draft(self, limit: int) -> tuple[int, ...]:
        """The tokens to verify with the request's next decode, at most `limit` (empty: decode plainly)."""
        if limit <= 0 or not self.synced:
            return ()
        return self.ids[self.pos : self.pos + min(self.size, limit)]

    def push(self, token: int) -> None:
        """The output took `token`: follow it in the prediction, or look for where it rejoins."""
        self._recent = (self._recent + [token])[-self.ngram :]
        if self.synced and self.pos < len(self.ids) and self.ids[self.pos] == token:
            self.pos += 1
            self.accepted += 1
            return
        self.synced = False
        self._resync()

    def verified(self, drafted: int, accepted: int) -> None:
        """A chunk drafted `drafted` tokens, of which the first `accepted` were the output."""
        self.rejected += drafted - accepted
        self.size = min(2 * self.size, self.most) if accepted == drafted else max(self.first, accepted + 1)

    def _resync(self) -> None:
        if len(self._recent) < self.ngram:
            return
        if self._after is None:
            self._after = defaultdict(list)
            n = self.ngram
            for i in range(len(self.ids) - n + 1):
                self._after[self.ids[i : i + n]].append(i + n)
        found = self._after.get(tuple(self._recent))
        if not found:
            return
        ahead = [p for p in found if p >= self.pos]  # the text goes on forward from where it was
        self.pos = ahead[0] if ahead else found[0]
        self.synced, self.size = self.pos < len(self.ids), self.first
