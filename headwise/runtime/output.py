"""Text at the edge and the one finish rule: prompts in, text out, for generate(), the engine and the server.

    out = OutputProcessor(model.tokenizer)             # None for a model without a tokenizer
    prompts, single = out.prompts(["Hi!", [{"role": "user", "content": "Hi"}], [1, 2, 3]])
    seq = out.sequence(prompts[0], params)             # per-sequence text state
    seq.push(token_id); piece = seq.new_text()         # streamed text; stop strings held back

`TextSequence.push` is the one finish rule: a stop id (EOS, end of turn, stop_token_ids),
a stop string (the text is cut before it; it wins over the length limit on the same token),
max_new_tokens ("length"); `check_context` is the one context-limit check, made before a
request runs; an abort is the scheduler's (`Core.finish`). Models only ever see token ids. Chat messages go through the model's
chat template; generated ids are detokenized incrementally (a piece never splits a UTF-8
character); stop strings are found as the text grows, even when they straddle tokens, and
while streaming, text that could still become a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


class StopScan:
    """Where the text stands against each stop string, updated one new character at a time
    (Knuth, Morris & Pratt 1977): state[j] is the length of the longest prefix of stop j that
    the text ends with. A push then costs O(new characters) per stop (amortized), however long
    the text or the stops are; a full rescan per token was O(text) per stop, O(text^2) per
    sequence. state also says how much of the tail could still become a stop (held back when
    streaming). `compared` counts character comparisons: the work, for tests."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)
        self.compared = 0

    def feed(self, text: str, start: int) -> int | None:
        """Scan text[start:] (the new piece); -> where the earliest stop found in it begins, or None."""
        piece = text[start:]
        best = None
        for j, s in enumerate(self.stops):
            k, fail, n = self.state[j], self.fail[j], len(s)
            if k == 0 and s[0] not in piece:  # the common case, at C speed
                self.compared += len(piece)
                continue
            for i, c in enumerate(piece):
                while k and s[k] != c:
                    k = fail[k - 1]
                    self.compared += 1
                self.compared += 1
                if s[k] == c:
                    k += 1
                if k == n:  # earliest end is the earliest start for this stop
                    begin = start + i + 1 - n
                    best = begin if best is None else min(best, begin)
                    break
            self.state[j] = k
        return best

    def held(self) -> int:
        """Characters at the end of the text that are a proper prefix of some stop."""
        return max(self.state, default=0)


def _failure(s: str) -> list[int]:
    """KMP failure table: f[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


@dataclass(frozen=True)
class Resume:
    """A completion begun elsewhere (a replica that died mid-stream): the ids it generated,
    which the model now reads as prompt, and how many characters of their text the client has.
    The text state picks up where that stream stopped: what it held back (a stop-string prefix,
    an unfinished UTF-8 character) comes out next, and a stop string may straddle the seam."""

    token_ids: tuple[int, ...]
    text_chars: int  # characters of decode(token_ids) already streamed


@dataclass
class TextSequence:
    """One sequence's output while decoding: token ids, text, stop detection, finish reason."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    decoder: object | None  # StreamDecoder (push(id) -> str, flush()), None: no text
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # chars of text already streamed
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    stops: StopScan | None = None
    resumed: int = 0  # the prompt's last ids that a Resume brought (generated elsewhere)

    def __post_init__(self):
        self.stops = StopScan(self.params.stop)

    def push(self, token: int) -> None:
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return
        if self.decoder is not None:
            before = len(self.text)
            self.text += self.decoder.push(token)
            hit = self.stops.feed(self.text, before) if self.params.stop else None
            if hit is not None:
                self.text = self.text[:hit]
                self.finish_reason = "stop"
                return
        if len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            if self.decoder is not None:
                self.text += self.decoder.flush()

    def resume(self, r: Resume) -> None:
        """Start from text already generated and partly streamed (`Resume`). token_ids stays
        empty: max_new_tokens counts this run's tokens, as the engine core does. `resumed`: how
        many of the prompt's last ids are these, which the runner computes as decode rows."""
        self.resumed = len(r.token_ids)
        if self.decoder is not None:
            for t in r.token_ids:
                self.text += self.decoder.push(t)
            if self.params.stop:
                self.stops.feed(self.text, 0)
        self.emitted = min(r.text_chars, len(self.text))

    def new_text(self) -> str:
        """Text that is safe to stream now: all of it once finished, else all but a tail
        that could still grow into a stop string."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self.stops.held()
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece


def check_context(prompt_len: int, max_new_tokens: int, max_model_len: int, source: str, what: str = "the prompt"):
    """ValueError when a prompt of prompt_len tokens plus max_new_tokens does not fit in max_model_len
    (source: where the limit comes from, for the message)."""
    if prompt_len + max_new_tokens > max_model_len:
        raise ValueError(
            f"{what} has {prompt_len} tokens; with max_new_tokens={max_new_tokens} that exceeds "
            f"max_model_len={max_model_len} ({source})"
        )


def is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], dict)


def stop_ids(tok, params: SamplingParams) -> frozenset:
    """Token ids that end a sequence: stop_token_ids, plus the tokenizer's end-of-turn/EOS ids
    unless ignore_eos (a model without a tokenizer has no EOS here)."""
    return frozenset(params.stop_token_ids) | (
        frozenset()
        if params.ignore_eos or tok is None
        else frozenset(getattr(tok, "stop_token_ids", None) or {tok.eos_token_id})
    )


def stream_decoder(tok):
    """An incremental detokenizer for `tok`, or None without a tokenizer."""
    if tok is None:
        return None
    from ..models.stream_decode import StreamDecoder

    return StreamDecoder(tok)


class OutputProcessor:
    """A model's text side: prompts (text, chat messages, ids) -> token ids, and per-sequence
    text state for the ids that come back. tokenizer None: ids in, ids out (text stays "")."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def chat_text(self, messages, **context) -> str:
        """Chat messages -> the prompt text of the model's template, ready for the assistant's turn.
        context reaches the template (tools=[...] for a template that renders tools)."""
        return self._tok("chat messages").apply_chat_template(list(messages), add_generation_prompt=True, **context)

    def encode(self, prompt) -> list[int]:
        """One text or chat prompt -> token ids (a template writes its own BOS/role tokens)."""
        tok = self._tok("text")
        if is_chat(prompt):
            return tok.encode(self.chat_text(prompt), add_special_tokens=False)
        return tok.encode(prompt)

    def prompts(self, prompt) -> tuple[list[list[int]], bool]:
        """-> (list of token-id prompts, single?) from str / ids / chat messages, or a list of them.
        A tensor of ids is one prompt when 1-D (T,) and a batch when 2-D (B, T)."""
        if isinstance(prompt, torch.Tensor) and (prompt.dim() not in (1, 2) or prompt.is_floating_point()):
            raise ValueError(
                f"a tensor prompt must hold integer token ids, (T,) or (B, T); got {prompt.dtype} {tuple(prompt.shape)}"
            )
        single = (
            isinstance(prompt, str)
            or is_chat(prompt)
            or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1)
            or (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], int))
        )
        items = [prompt] if single else list(prompt)
        if not items:
            raise ValueError("no prompts given")
        out = []
        for i, p in enumerate(items):
            if isinstance(p, str) or is_chat(p):
                ids = self.encode(p)
            elif isinstance(p, torch.Tensor):
                ids = p.reshape(-1).tolist()
            else:
                ids = list(p)
            if not ids:
                raise ValueError(f"prompt {i} is empty (0 tokens); give at least one token")
            out.append([int(t) for t in ids])
        return out, single

    def stop_ids(self, params: SamplingParams) -> frozenset:
        return stop_ids(self.tokenizer, params)

    def sequence(self, prompt: list[int], params: SamplingParams, stops: frozenset | None = None) -> TextSequence:
        """The text state of one completion of `prompt`."""
        return TextSequence(
            prompt, params, self.stop_ids(params) if stops is None else stops, stream_decoder(self.tokenizer)
        )

    def _tok(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"this model has no tokenizer: pass token ids instead of {what}")
        return self.tokenizer
