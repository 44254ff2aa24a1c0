"""KV caches in the (B, Hkv, S, D) layout, behind one protocol (see protocol.py).

ContiguousKVCache   preallocated (B, Hkv, T_max, D) per layer, written in place
SlidingWindowCache  ring buffer of the last W tokens (sliding-window attention)
PagedKVCache        block tables over a shared block pool (paged.py)
HybridPagedKVCache  layers of different windows (Gemma 3): one pool, a block table per group
                    of layers, windowed groups giving back what falls out of the window
kv_dtype="int8"     int8 K/V + fp32 scale per (token, head) (quantized.py)
kv_dtype="bfloat16" / "float16": 16-bit K/V, read as stored by the C decode kernels (docs/kv-cache.md)
"""

from .block_pool import BlockPool, CacheFull
from .contiguous import ContiguousKVCache, ContiguousLayerCache
from .hybrid import HybridPagedKVCache
from .paged import PagedKVCache, UnknownSequence
from .protocol import CacheRead, LayerKVCache
from .quantized import Int8CacheRead, dequantize_int8, kv_bytes_per_token, quantize_int8
from .sliding import SlidingWindowCache, SlidingWindowLayerCache

__all__ = [
    "CacheRead",
    "LayerKVCache",
    "ContiguousKVCache",
    "ContiguousLayerCache",
    "SlidingWindowCache",
    "SlidingWindowLayerCache",
    "Int8CacheRead",
    "quantize_int8",
    "dequantize_int8",
    "kv_bytes_per_token",
    "BlockPool",
    "CacheFull",
    "PagedKVCache",
    "HybridPagedKVCache",
    "UnknownSequence",
]
