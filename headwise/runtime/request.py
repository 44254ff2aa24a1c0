"""What the engine schedules and what it hands back.

A user's request (`RequestGroup`) asks for `sampling.n` completions of one prompt; each
completion is a `Request`, the unit the scheduler runs (vLLM v1 fans n > 1 out the same
way). A `Request` has no prefill or decode phase, only a count: the model has computed
the first `num_computed_tokens` of `token_ids` (prompt, then generated ids); a step
computes some more, and when it reaches the end the next token is sampled.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .sampling import SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again (its K/V freed)
    RUNNING = "running"  # holds blocks in the cache; scheduled every step it can be
    FINISHED = "finished"


@dataclass
class StreamPiece:
    """What one step added to one completion (`index`) of a streamed request."""

    text: str  # new text; never splits a UTF-8 character, and text that
    # could still turn into a stop string is held back
    token_ids: list[int]  # new token ids (a final stop/EOS id included)
    index: int = 0  # completion index when sampling.n > 1
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if sampling.logprobs is set
    finish_reason: str | None = None  # None until the last piece: "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far by this completion
    # Predicted Outputs (sampling.prediction): draft tokens kept / computed and dropped, so far
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated ids (a final stop/EOS id included)
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    accepted_prediction_tokens: int = 0  # Predicted Outputs: draft tokens kept
    rejected_prediction_tokens: int = 0  # ... and computed but dropped


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per completion (sampling.n)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on admission

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class RequestGroup:
    """One add_request call: a prompt, its sampling, its n completions, and where pieces go.

    Fair shares (scheduler.py, fair.py): `priority` orders admission among equal shares (lower
    first, vLLM's convention); `client` (a server's hashed API key; None: the request stands
    alone) and `share` (the requests counted as one, a server's prompts of one API request;
    None: this group) say whose sequences these are."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Callable[[StreamPiece], None] | None,
        *,
        priority: int = 0,
        client: str | None = None,
        share: str | None = None,
    ):
        self.request_id, self.prompt_token_ids, self.params, self.sink = request_id, prompt, params, sink
        self.priority = priority
        self.share_key = ("share", request_id if share is None else share)
        self.client_key = self.share_key if client is None else ("client", client)
        self.arrival = time.perf_counter()
        self.children: list[Request] = []
        self.done = threading.Event()  # set when every completion has finished
        self.error: BaseException | None = None  # set if the engine failed while this ran
        self.keep_output = True  # kept for Engine.result() once finished (streams: no)
        # An async stream's reader (frontends.py: the stepping thread waits on it briefly after a
        # step): set while it has taken every piece handed to it; None: not a stream. Pieces handed
        # to it, pieces through its consumer, and how many had been handed at the last step's wait.
        self.reader_idle: threading.Event | None = None
        self.handed = self.taken = self.mark = 0

    @property
    def finished(self) -> bool:
        return all(c.status is Status.FINISHED for c in self.children)

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                c.index,
                c.text.text if c.text is not None else "",
                list(c.output_token_ids),
                c.finish_reason,
                list(c.logprobs) if self.params.logprobs is not None else None,
                *c.prediction_counts,
            )
            for c in self.children
        ]
        return RequestOutput(
            self.request_id,
            list(self.prompt_token_ids),
            outs,
            max((c.num_cached_tokens for c in self.children), default=0),
        )


@dataclass(eq=False)
class Request:
    """One completion of a prompt, as the scheduler and the engine core see it: token ids only."""

    group: RequestGroup
    index: int
    generator: torch.Generator | None = None  # per-request seed: sampling.seed + index
    seen: torch.Tensor | None = None  # (V,) bool, for the repetition penalty: prompt + output ids
    # (V,) float32, for the presence/frequency penalties: times each id was generated, kept as tokens come
    output_counts: torch.Tensor | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + generated ids
    num_computed_tokens: int = 0  # leading token_ids whose K/V the cache holds
    num_cached_tokens: int = 0  # of those, found by prefix on first admission
    status: Status = Status.WAITING
    num_preemptions: int = 0
    arrival: int = -1  # the scheduler's count when first added: ties of a fair share break by it
    output_token_ids: list[int] = field(default_factory=list)  # generated ids (a final stop/EOS id included)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if sampling.logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    first_token_at: float | None = None
    last_token_at: float | None = None
    text: object | None = None  # its TextSequence (output.py): detokenizer, stop strings, the finish rule
    prediction: object | None = None  # its predict.Prediction when sampling.prediction is set

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.group.request_id, self.index)

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.group.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prediction_counts(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens of its prediction so far; (0, 0) without one."""
        p = self.prediction
        return (p.accepted, p.rejected) if p is not None else (0, 0)
