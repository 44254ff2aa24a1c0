"""KV caches in the (B, Hkv, S, D) layout."""
from .protocol import CacheRead, LayerKVCache

__all__ = ["CacheRead", "LayerKVCache"]
