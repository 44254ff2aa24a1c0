"""Sampling: one description of how to pick tokens (`SamplingParams`), and the
operations the sampler's chain (sampler.py) is made of.

The order follows Hugging Face transformers and vLLM: logit_bias, then the repetition,
frequency and presence penalties, then temperature, then top-k, top-p and min-p filters,
then a draw from the softmax.
temperature == 0 means greedy. Filters never remove the most likely token, so
at least one candidate always survives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .predict import MAX_PREDICTION_TOKENS


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
# OpenAI allows 4 stop strings; vLLM any number. 16 of up to 1,000 characters keeps the
# per-token stop check (on the engine thread, for every sequence) small.
MAX_STOPS = 16
MAX_STOP_CHARS = 1000


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 (or < 1e-5) = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max (Nguyen et al. 2024)
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019): divide positive logits of seen tokens
    # OpenAI's penalties, on the generated tokens only (as OpenAI and vLLM): logit -= presence * (count > 0)
    # + frequency * count, count = times the id was generated so far; in [-2, 2], 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: token id -> value in [-100, 100] added to its logit (-100 bans, +100 forces);
    # not hashed (a dict), compared
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before them
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1  # completions per prompt
    logprobs: int | None = None  # return the chosen token's logprob and this many alternatives
    # per-request links of the sampler's chain, applied first (sampler.LogitsProcessor: a grammar
    # mask, logit_bias); each sees the request's tokens so far, batched across the requests carrying it
    logits_processors: tuple = ()
    # OpenAI's Predicted Outputs: token ids the output is expected to repeat (the file being edited);
    # the engine verifies them in chunks instead of generating one token per step (predict.py). The
    # output is the same as without it; only the speed changes
    prediction: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.prediction is not None:
            object.__setattr__(self, "prediction", tuple(self.prediction) or None)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)  # a copy: params are frozen
        bias = self.logit_bias or {}
        bad_id = next((t for t in bias if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
        bad_bias = next((t for t, v in bias.items() if not -100 <= v <= 100), None)
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (bad_id is None, f"logit_bias keys must be token ids (ints >= 0), got {bad_id!r}"),
            (
                bad_bias is None,
                f"logit_bias values must be in [-100, 100], got {bias.get(bad_bias)} for token {bad_bias}",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (
                all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prediction or ()),
                "prediction must be token ids (ints >= 0)",
            ),
            (
                len(self.prediction or ()) <= MAX_PREDICTION_TOKENS,
                f"a prediction may have at most {MAX_PREDICTION_TOKENS} tokens, got {len(self.prediction or ())}",
            ),
            (all(callable(p) for p in self.logits_processors), "logits_processors must be callables"),
            (len(self.stop) <= MAX_STOPS, f"at most {MAX_STOPS} stop strings are allowed, got {len(self.stop)}"),
            (
                all(len(s) <= MAX_STOP_CHARS for s in self.stop),
                f"stop strings may have at most {MAX_STOP_CHARS} "
                f"characters, got one of {max(map(len, self.stop), default=0)}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def penalized(self) -> bool:
        """Whether the frequency or presence penalty is on (the request then counts its output ids)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain(self) -> bool:
        """Nothing but the raw logits decides the token: no processor, penalty or bias."""
        return not (self.logits_processors or self.logit_bias or self.repetition_penalty != 1.0 or self.penalized)

    @property
    def greedy(self) -> bool:
        # As vLLM: below 1e-5 sampling is argmax anyway, and 1/T would overflow float32.
        return self.temperature < GREEDY_BELOW


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits (B, V); seen (B, V) bool: tokens in the prompt or output so far."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_penalties(logits: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor) -> Tensor:
    """OpenAI's presence and frequency penalties: logits (B, V) - frequency (B, 1) * counts
    - presence (B, 1) * (counts > 0); counts (B, V): times each id was generated so far."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Set filtered-out entries of logits (B, V) to -inf. Temperature is applied before."""
    neg_inf = torch.finfo(logits.dtype).min if logits.dtype != torch.float32 else float("-inf")
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), neg_inf)
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), neg_inf)
    return logits


def skip_draws(generator: torch.Generator, n: int, vocab: int) -> None:
    """Advance `generator` past n calls of sample() on (1, vocab) logits, as if n tokens had been
    drawn: torch.multinomial draws one exponential per vocabulary entry whatever the
    probabilities, so a seeded request resumed elsewhere draws what it would have drawn."""
    flat = torch.ones(1, vocab)
    for _ in range(n):
        torch.multinomial(flat, 1, generator=generator)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), most likely first


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> list[TokenLogprobs]:
    """Logprobs of the chosen tokens under the unmodified distribution, plus the top k."""
    logp = logits.float().log_softmax(dim=-1)  # (B, V)
    chosen = logp.gather(-1, token_ids[:, None]).squeeze(-1)
    out = []
    top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
    for b in range(logits.shape[0]):
        top = list(zip(top_i[b].tolist(), top_v[b].tolist())) if k else []
        out.append(TokenLogprobs(int(token_ids[b]), float(chosen[b]), top))
    return out
