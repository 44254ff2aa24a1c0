"""Continuous batching: many requests share each forward pass over a paged KV cache.

config.py      EngineConfig: the limits, validated once (the server and the planner use it too)
request.py     Request (one completion: token ids, num_computed_tokens), StreamPiece, RequestOutput
scheduler.py   token budget, chunked prefill, prefix hits, preemption; QueueFull
runner.py      ModelRunner: a batch -> input_ids (1, N), the packed step, logits of the sampled rows
sampler.py     per-request sampling of a step's rows
core.py        EngineCore.step(): schedule -> run -> sample -> update; token ids only
engine.py      Engine: the front end: a background thread, generate / stream / abort, text, stats
stats.py       EngineStats
"""

from .config import EngineConfig
from .core import EngineCore
from .engine import Engine
from .request import CompletionOutput, Request, RequestOutput, StreamPiece
from .scheduler import QueueFull, Scheduler
from .stats import EngineStats

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "QueueFull",
    "RequestOutput",
    "CompletionOutput",
    "StreamPiece",
    "Request",
    "Scheduler",
]
