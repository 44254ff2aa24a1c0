"""The one way to run a model: scheduler -> runner -> sampler -> output, stepped by `Core`.

generate() runs it over a fixed batch and a contiguous cache (batch.py); the Engine and the
server over the paged pool with continuous batching (paged.py). See core.py.
"""

from .config import EngineConfig
from .core import Core, TokenOutput
from .paged import EngineCore
from .request import CompletionOutput, Request, RequestGroup, RequestOutput, Status, StreamPiece
from .sampler import LogitsProcessor, Sampler, sample
from .sampling import SamplingParams, TokenLogprobs

__all__ = [
    "CompletionOutput",
    "Core",
    "EngineConfig",
    "EngineCore",
    "LogitsProcessor",
    "Request",
    "RequestGroup",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "Status",
    "StreamPiece",
    "TokenLogprobs",
    "TokenOutput",
    "sample",
]
