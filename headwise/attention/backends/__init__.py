"""Attention backends, registered in the order `backend="auto"` tries them:

1. flash   - flash-attn on CUDA (fp16/bf16; no arbitrary or padding masks)
2. decode  - headwise's CPU kernel for queries that see every key (decode steps; fp32)
3. prefill - headwise's CPU kernel for many queries, causal or unmasked (prefills, the layer; fp32)
4. sdpa    - torch.nn.functional.scaled_dot_product_attention (fused, any device)
5. chunked - pure-PyTorch online softmax over key tiles (O(T) memory, LSE, no dropout)
6. paged   - K/V in a paged cache's block pool, read in place (runs, regions, tiles);
             takes a cache's description (`kv.LayerKV`), not tensors
7. math    - the reference; the only backend that returns weights
"""

from .chunked import chunked_attention, chunked_check
from .decode import decode_attention, decode_check
from .flash import flash_attention, flash_check
from .math import math_attention, math_check
from .merge import merge_lse
from .paged import paged_attention
from .prefill import PREFILL_WHY, prefill_attention, prefill_check
from .paged_spec import paged_check
from .registry import Backend, backends, get_backend, register_backend
from .sdpa import sdpa_attention, sdpa_check

register_backend(
    "flash",
    flash_attention,
    flash_check,
    description="flash-attn package, CUDA only",
    why="CUDA fp16/bf16 without arbitrary masks: flash-attn's kernel",
)
register_backend(
    "decode",
    decode_attention,
    decode_check,
    description="headwise's CPU decode kernel, no mask",
    why="fp32 CPU queries that see every key (a decode step): one pass over K/V, where SDPA's general "
    "tiling is most of the time for so few rows (benchmarks/decode.py)",
)
register_backend(
    "prefill",
    prefill_attention,
    prefill_check,
    description="headwise's CPU prefill kernel, causal or unmasked",
    why=PREFILL_WHY,
)
register_backend(
    "sdpa",
    sdpa_attention,
    sdpa_check,
    description="PyTorch fused scaled_dot_product_attention",
    why="PyTorch's fused op: any device and dtype, every mask, dropout and a backward",
)
register_backend(
    "chunked",
    chunked_attention,
    chunked_check,
    description="tiled online softmax, O(T) memory",
    why="O(T) memory with what sdpa declines (soft-capped scores)",
)
register_backend(
    "paged",
    paged_attention,
    paged_check,
    reads="blocks",
    description="block tables / packed steps of a paged cache, in place",
    why="K/V in a paged cache's blocks, read in place",
)
register_backend(
    "math",
    math_attention,
    math_check,
    description="reference; materializes scores",
    why="the reference: the only backend that returns weights",
)

__all__ = ["Backend", "backends", "get_backend", "register_backend", "merge_lse"]
