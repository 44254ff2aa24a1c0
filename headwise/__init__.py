"""headwise: multi-head attention from the layer to the API.

Torch-backed names load on first use, so `headwise plan` starts without torch, and so that
OpenMP's threads are set to wait passively before torch loads them (headwise/core/threads.py).
"""

from __future__ import annotations

import importlib

from .core.threads import configure_wait_policy

configure_wait_policy()

__version__ = "0.1.0"

_LAZY = {
    "attend": "headwise.attention",
    "explain": "headwise.attention",
    "MultiHeadAttention": "headwise.attention",
    "RotaryEmbedding": "headwise.attention",
    "AttentionConfig": "headwise.core.config",
    "ModelConfig": "headwise.core.config",
    "get_preset": "headwise.core.config",
    "load": "headwise.models.from_path",
    "generate": "headwise.generation",
    "SamplingParams": "headwise.generation",
    "GenerationResult": "headwise.generation",
    "embed": "headwise.models.embeddings",
    "Engine": "headwise.engine",
    "EngineConfig": "headwise.engine",
    "QueueFull": "headwise.engine",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'headwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
