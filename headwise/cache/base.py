"""What the contiguous and sliding caches share: per-sequence lengths and the stack of layers.

LayerCacheBase  one layer: a `KVStore` (store.py) plus lengths kept on the device and
                on the host, with reset / reorder / memory_bytes.
LayeredCache    a list of per-layer caches: `layer(i)`, `step(T)`, and, with one layer,
                the `LayerKVCache` methods themselves.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..attention.step import CacheStep
from .quantized import kv_kind, storage_dtype
from .store import KVStore, new_counts


# ------------------------------------------------------------------ one layer
class LayerCacheBase:
    """Per-sequence lengths and the bookkeeping every single-layer cache shares.

    Lengths live twice: (B,) on the device, for positions and masks inside a step,
    and as a host list, so checks and slicing never wait for the device.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        slots: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device,
        kv_dtype,
        static: bool = False,
    ):
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.dtype, self.static = dtype, static
        self.kv_dtype = kv_kind(kv_dtype)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        int8, stored = self.kv_dtype == "int8", storage_dtype(self.kv_dtype, dtype)
        self.store = KVStore(
            batch_size, num_kv_heads, slots, head_dim, dtype=dtype, device=self.device, int8=int8, stored=stored
        )
        self._len = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) tokens seen
        self._host = [0] * batch_size  # the same on the host
        self._uniform = True  # all _host equal

    def positions(self, num_new: int) -> Tensor:
        """(B, T) absolute positions of the next T tokens: L_b + t."""
        if not self.static and self._uniform:  # `static` first: a compiled step never reads _uniform
            L = self._host[0]
            return torch.arange(L, L + num_new, device=self.device).expand(self.batch_size, num_new)
        return self._len[:, None] + torch.arange(num_new, device=self.device)

    def positions_run(self, num_new: int) -> tuple[int, int, int] | None:
        """(L, B, T): every sequence's next T tokens at positions L .. L + T - 1, known on the host
        (Step.rope_rows reads RoPE's rows from a table then); None where lengths differ or the
        cache is static (a compiled step reads no host state)."""
        if not self.static and self._uniform:
            return self._host[0], self.batch_size, num_new
        return None

    @property
    def lengths(self) -> Tensor:
        """(B,) long: tokens appended per sequence (real ones; padding is not counted)."""
        return self._len.clone()

    def _book(self, T: int, num_new) -> list[int] | None:
        """Check that the new tokens fit and advance the host lengths (the device ones are the
        caller's). Returns the real-token counts per sequence, or None when all T are real."""
        counts = new_counts(num_new, self.batch_size, T)
        n = [T] * self.batch_size if counts is None else counts
        self._check_fits(n)
        self._host = [L + c for L, c in zip(self._host, n)]
        self._uniform = len(set(self._host)) == 1
        return counts

    def _check_fits(self, n: list[int]) -> None:
        """Raise if n[b] more tokens do not fit sequence b (a ring always has room)."""

    def _set_lengths(self, rows: list[int]) -> None:
        self._host = list(rows)
        self._uniform = len(set(rows)) == 1
        if self.static:
            self._len.copy_(torch.tensor(rows, dtype=torch.long))  # the tensor a compiled step reads
        else:
            self._len = torch.tensor(rows, dtype=torch.long, device=self.device)  # never shared and written

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget every sequence, or only `rows` (their slots are reused; nothing is zeroed)."""
        drop = set(range(self.batch_size)) if rows is None else {int(r) for r in rows}
        self._set_lengths([0 if b in drop else L for b, L in enumerate(self._host)])

    def reorder(self, batch_indices: Sequence[int] | Tensor) -> None:
        """Row i becomes a copy of old row batch_indices[i] (beam search); the batch size stays."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long).reshape(-1)
        B = self.batch_size
        if idx.numel() != B or ((idx < 0) | (idx >= B)).any():
            raise ValueError(f"reorder needs {B} row indices in [0, {B}), got {idx.tolist()}")
        self.store.reorder(idx.to(self.device))
        self._set_lengths([self._host[i] for i in idx.tolist()])

    def memory_bytes(self) -> int:
        """Bytes of K/V storage (int8: values + scales), allocated up front."""
        return self.store.nbytes()


class StackParts:
    """What a cache's stack claim hands out (ContiguousKVCache.claim_decode_stack,
    PackedStep.claim_stack): per layer (K, V, head stride, key stride). A caller may build on it
    while it is the object handed out (it can hold a weak reference: the cache holds the strong
    one)."""

    __slots__ = ("rows", "cache_layers", "layers", "base", "__weakref__")

    def __init__(self, rows: int | None, cache_layers: list, layers: list[tuple], base: Tensor | None = None):
        self.rows, self.cache_layers, self.layers, self.base = rows, cache_layers, layers, base


# ------------------------------------------------------------------ all layers
class LayeredCache:
    """A stack of per-layer caches: `cache.layer(i)` goes to attention layer i.

    With one layer the stack itself is a `LayerKVCache`, so it can be passed
    straight to one `MultiHeadAttention(cache=...)`.
    """

    layers: list

    def layer(self, i: int):
        if not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range: this cache has num_layers={len(self.layers)}")
        return self.layers[i]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens per sequence, as layer 0 holds them (all layers agree after a full model step)."""
        return self.layers[0].lengths

    def step(self, T: int, num_new: Tensor | None = None, logits_indices: Tensor | None = None) -> CacheStep:
        """The `Step` of T new tokens per sequence (`model(input_ids, cache.step(T))`).

        num_new: (B,) real tokens per sequence when rows are right-padded (the padding is not
        kept); None = all T. logits_indices: flat rows b * T + t whose logits are wanted.
        """
        return CacheStep(self.layer, T, num_new, logits_indices, getattr(self, "claim_decode_stack", None))

    def _only_layer(self):
        if len(self.layers) != 1:
            raise TypeError(f"this cache has num_layers={len(self.layers)}; pass cache.layer(i) to layer i")
        return self.layers[0]

    def positions(self, num_new: int) -> Tensor:
        return self._only_layer().positions(num_new)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None):
        return self._only_layer().update(k, v, num_new)

    def reset(self, rows: Sequence[int] | None = None) -> None:
        for layer in self.layers:
            layer.reset(rows)

    def reorder(self, batch_indices: Sequence[int] | Tensor) -> None:
        for layer in self.layers:
            layer.reorder(batch_indices)

    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)
