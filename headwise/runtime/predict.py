"""Predicted Outputs: a request says what it expects its output to be (OpenAI's `prediction`, e.g.
the file being edited), and the engine verifies that text instead of generating it token by token.

Each decode step of such a request drafts the next tokens of the prediction after its last token
and computes them in the same forward (one chunk of 1 + k tokens: the scheduler's `Chunk.draft`).
The core then samples the chunk's rows in order, each with the request's own sampling state,
appending each token, and stops at the first that differs from the draft (core.py): each token is
drawn from the model's distribution at that point, as sampling one token at a time would draw it,
for greedy and for sampling (the draft only decides how many rows were computed ahead; the rows run
as decode rows of one sequence, which round as any batch does: docs/predicted-outputs.md). The K/V
of the rejected rows is dropped (`PagedKVCache.truncate`).

Where the prediction is: `pos`, the index of the next expected token. While the output follows
the prediction, the draft is `ids[pos : pos + k]`, with k one rung up `DRAFT_SIZES` after a draft
accepted whole, back to the first after a miss. Once the output leaves the prediction (the edit
itself), nothing is drafted until its last `ngram` tokens occur in the prediction again: the
output rejoined the text (the unchanged rest of the file), and drafting resumes there.
"""

from __future__ import annotations

from collections import defaultdict

MAX_PREDICTION_TOKENS = 32768  # what a request may carry; the n-gram index is built once per request
# Draft lengths, climbed one rung per draft accepted whole and back to the first after a miss. A
# decode with k drafts runs k + 1 rows through the decode stack: 3 rows cost ~1.3 decodes, 8 rows
# ~2.8, 16 ~4.4 (SmolLM2 Q4_1, AMD Zen 4, 1 thread; a step up at 4 rows, where the AVX-512 quantized
# kernel changes tiles), and each step also pays ~3 ms of scheduling and sampling: short drafts where a
# miss is likely, long ones once the output has followed the prediction for a while. Measured on the
# edit task of benchmarks/predicted.py (fp32, 1 thread): (2, 7, 15) 2.16x, (2, 7, 15, 31) 2.11x, (2,) 1.66x.
DRAFT_SIZES = (2, 7, 15)


class Prediction:
    """The draft state of one completion (a `Request.prediction`)."""

    def __init__(self, ids, *, sizes: tuple[int, ...] = DRAFT_SIZES, ngram: int = 3):
        self.ids = tuple(int(t) for t in ids)
        self.sizes, self.ngram = sizes, ngram
        self.pos, self.synced, self.rung = 0, True, 0
        # OpenAI's usage: output tokens that followed the prediction / draft tokens computed and dropped
        self.accepted = self.rejected = 0
        self._recent: list[int] = []  # the output's last `ngram` tokens
        self._after: dict[tuple, list[int]] | None = None  # n-gram -> positions after it (built on first miss)

    def draft(self, limit: int) -> tuple[int, ...]:
        """The tokens to verify with the request's next decode, at most `limit` (empty: decode plainly)."""
        if limit <= 0 or not self.synced:
            return ()
        return self.ids[self.pos : self.pos + min(self.sizes[self.rung], limit)]

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
        self.rung = min(self.rung + 1, len(self.sizes) - 1) if accepted == drafted else 0

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
        self.synced, self.rung = self.pos < len(self.ids), 0
