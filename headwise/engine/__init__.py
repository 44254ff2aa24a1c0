"""Continuous batching: many requests share each forward pass over a paged KV cache.

engine.py      Engine: the front end: a background thread, generate / stream / abort, text, stats
frontends.py   generate(), stream() and the stepping thread of an Engine
stats.py       EngineStats

The loop it steps (scheduler -> runner -> sampler -> output) is the runtime's (headwise.runtime),
the same one generate() runs; its parts are re-exported here.
"""

from ..runtime.config import EngineConfig
from ..runtime.paged import EngineCore
from ..runtime.request import CompletionOutput, Request, RequestOutput, StreamPiece
from ..runtime.scheduler import QueueFull, Scheduler
from .engine import Engine
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
