"""`generate(..., compile=True)`: the one-token decode step as one torch.compile graph.

Eager decoding on CPU pays PyTorch's per-op overhead hundreds of times a token (norms,
RoPE, the attention call, residual adds: ~12 small ops per layer). Compiled, inductor fuses
those elementwise chains into a few C++ loops and, with `freezing`, prepacks the weights for
oneDNN as `PackedLinear` does. For one graph with no recompiles per step:

- the cache is static (`ContiguousKVCache(static=True)`): every read covers all slots with a
  mask, so shapes depend on the batch and the cache size only, never on the lengths;
- its host-side bookkeeping runs before the graph (`cache.book(1)`), not inside it;
- the cache size is rounded up to a multiple of SLOTS_QUANTUM, so calls of similar lengths
  share a graph (each distinct (batch, size) compiles once: ~20-40 s on 2 idle cores).

Freezing folds the weights into the graph as constants: edit a compiled model's weights and
its compiled step does not see it (call `reset_compiled(model)`). Prefill stays eager.
"""

from __future__ import annotations

import weakref

import torch

SLOTS_QUANTUM = 256
# model -> (its compiled decode step, its static caches by (batch, slots, dtype, device)); forgotten
# with the model, or by reset_compiled
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def static_cache_size(needed: int, max_positions: int) -> int:
    return min(max_positions, -(-needed // SLOTS_QUANTUM) * SLOTS_QUANTUM)


def compiled_decode_step(model):
    """model -> step(ids (B, 1), cache) -> (B, V) logits of the last position, compiled once
    per model (dynamo guards recompile it for a new batch size or cache size)."""
    entry = _COMPILED.get(model)
    if entry is None:
        ref = weakref.ref(model)  # the step must not keep its model alive

        def decode(ids, cache):
            return ref()(ids, cache=cache)[:, -1]

        entry = _COMPILED[model] = (
            torch.compile(decode, dynamic=False, fullgraph=True, options={"freezing": True}),
            {},
        )
    return entry[0]


def static_cache(model, batch_size: int, slots: int, *, dtype, device):
    """The model's static cache for (batch_size, slots), emptied, made on first use. Reused
    across calls because dynamo guards on the identity of the cache's Python members: a
    fresh cache per call would recompile the step every call."""
    from ..cache import ContiguousKVCache
    from .windows import model_windows

    compiled_decode_step(model)
    caches = _COMPILED[model][1]
    key = (batch_size, slots, dtype, str(device))
    cache = caches.get(key)
    if cache is None:
        cfg = model.config
        cache = caches[key] = ContiguousKVCache(
            cfg.num_layers,
            batch_size,
            cfg.num_kv_heads,
            slots,
            cfg.head_dim,
            dtype=dtype,
            device=device,
            static=True,
            windows=model_windows(cfg),  # kept in the static mask: every slot stays (one graph)
        )
    cache.reset()
    return cache


def reset_compiled(model) -> None:
    """Forget the compiled step and its caches (after editing weights, which freezing baked in)."""
    _COMPILED.pop(model, None)
