"""Continuous batching: many requests share each forward pass over a paged KV cache.

    request.py     Request (one completion: token ids, num_computed_tokens), StreamPiece, RequestOutput
    scheduler.py   token budget, chunked prefill, prefix hits, preemption; QueueFull
    sampler.py     per-request sampling of a step's rows
    engine.py      Engine: the step loop in a background thread, generate / stream / abort / stats
"""
from .engine import Engine, EngineStats
from .request import CompletionOutput, Request, RequestOutput, StreamPiece
from .scheduler import QueueFull, Scheduler

__all__ = ["Engine", "EngineStats", "QueueFull", "RequestOutput", "CompletionOutput", "StreamPiece", "Request",
           "Scheduler"]
