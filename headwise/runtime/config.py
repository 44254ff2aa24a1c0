"""`EngineConfig`: the engine's limits, validated once; `Engine`, `headwise serve` and the planner use it.

    config = EngineConfig(max_num_seqs=16, memory_budget_bytes=256 * 2**20)
    engine = headwise.Engine(model, config=config)          # or Engine(model, max_num_seqs=16, ...)
    config.resolve(model.config, "float32").num_blocks       # the pool that engine allocates

The fields that depend on a model (num_blocks from a memory budget, max_waiting_tokens from
the pool, max_model_len) are derived by `resolve` / `max_model_len`; the pool is sized by the
planner's formula (`headwise.core.plan.kv_pool_blocks`), so `headwise plan` and the engine agree.
No torch here: the server's config and the planner import this without loading it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..core.plan import kv_layer_groups, kv_pool_blocks, kv_pool_blocks_per_sequence, kv_pool_bytes_per_token

# The KV pool when neither num_blocks nor memory_budget_bytes is given: 32k tokens (of every layer),
# llama-server's -c 32768, at most a quarter of the memory available when the engine is built and
# no more than max_num_seqs sequences of the model's whole context need. Its bytes follow the dtype
# stored: SmolLM2-135M 0.70 GiB in 16-bit (23 KiB a token), 1.41 GiB in fp32. The pool's pages
# become resident as blocks are first written (cache/paged_store.py), not when it is allocated.
DEFAULT_KV_TOKENS = 32768
KV_DTYPES = (None, "float32", "int8", "bfloat16", "float16")
KV_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
# The 16-bit K/V of a quantized model when kv_dtype is not given: the one the C decode kernels read
# fastest (benchmarks/kv16.py, AMD EPYC Zen 4, 1 thread, decode attention over SmolLM2's heads):
# the avx512 variant widens both in one zmm op each, bf16 ~= fp16 (+-2%), so bfloat16 (fp32's range:
# no key overflows to inf); the avx2 variant's vcvtph2ps beats bf16's two-op shift (fp16 1.05-1.1x
# at 4k keys), so float16 there. Without the kernels, bfloat16 (PyTorch converts either).
DEFAULT_KV16 = {"avx512": "bfloat16", "avx2": "float16"}


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences running at once (each holds KV blocks)
    num_blocks: int | None = None  # KV pool size in blocks; None: sized from memory_budget_bytes. A
    # block holds block_size tokens of one group of layers (all of them, unless the model's layers
    # differ in window: then core.plan.kv_layer_groups' g layers, one block table per group)
    block_size: int = 16  # tokens per KV block: a prefix is shared in whole blocks
    max_num_batched_tokens: int = 512  # tokens computed per step (decodes + prefill chunks)
    kv_dtype: str | None = None  # None: 16-bit (default_kv16) for a quantized model, else the model's
    # dtype (kv_dtype_for); "float32" (the model's dtype, always), "bfloat16" / "float16" (half of
    # fp32's bytes) or "int8" (~1/4)
    max_waiting_requests: int = 256  # beyond this add_request raises QueueFull (a server's 429)
    max_waiting_tokens: int | None = None  # prompt tokens waiting; None = 4x what the KV pool holds
    memory_budget_bytes: int | None = None  # bytes for the pool when num_blocks is None (None:
    # DEFAULT_KV_TOKENS tokens, at most a quarter of the memory available)

    def __post_init__(self):
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "max_waiting_requests"):
            value = getattr(self, name)
            if not _positive(value):
                raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}")
        for name in ("num_blocks", "max_waiting_tokens", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ValueError(f"{name} must be a positive int or None (sized for you), got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: every running sequence needs a token of the step budget to "
                f"decode; raise max_num_batched_tokens or lower max_num_seqs"
            )
        kv = str(self.kv_dtype).removeprefix("torch.").lower() if self.kv_dtype is not None else None
        kv = KV_DTYPE_ALIASES.get(kv, kv)
        if kv not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be None (16-bit K/V for a model with quantized weights, the compute dtype "
                f"otherwise), 'float32', 'bfloat16', 'float16' or 'int8', got {self.kv_dtype!r}"
            )
        object.__setattr__(self, "kv_dtype", kv)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ model-dependent sizes
    def kv_pool_dtype(self, dtype) -> str:
        """The dtype the pool stores, as the planner names it: kv_dtype ("int8", "bfloat16", ...), or
        the model's ("float32"). Call on a config whose kv_dtype is decided (`for_model`)."""
        if self.kv_dtype is None or self.kv_dtype == "float32":
            return str(dtype).removeprefix("torch.")
        return self.kv_dtype

    def for_model(self, model) -> "EngineConfig":
        """This config with kv_dtype decided for `model` (kv_dtype_for): what the engine stores."""
        return self.replace(kv_dtype=kv_dtype_for(self.kv_dtype, model))

    def blocks_for(self, model_config, dtype) -> int:
        """KV blocks the pool gets for a model (its ModelConfig) computing in `dtype`."""
        if self.num_blocks is not None:
            return self.num_blocks
        kv = self.kv_pool_dtype(dtype)
        if self.memory_budget_bytes is not None:
            blocks = kv_pool_blocks(model_config, self.memory_budget_bytes, block_size=self.block_size, dtype=kv)
            if blocks < 1:
                g = kv_layer_groups(model_config)[0]  # layers a block holds (all, unless windows differ)
                per_token = kv_pool_bytes_per_token(model_config, kv) * g // model_config.num_layers
                raise ValueError(
                    f"memory_budget_bytes={self.memory_budget_bytes} does not hold one KV block "
                    f"({per_token * self.block_size} bytes: {self.block_size} tokens x {per_token} "
                    f"bytes per token{'' if g == model_config.num_layers else f' of its {g} layers'}); "
                    f"give more, or a smaller block_size"
                )
            return blocks
        tokens = DEFAULT_KV_TOKENS * kv_pool_bytes_per_token(model_config, kv)  # bytes of 32k tokens, all layers
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = 4 * tokens
        budget = min(tokens, available // 4)
        per_seq = kv_pool_blocks_per_sequence(
            model_config, model_config.max_positions, self.block_size, self.max_num_batched_tokens
        )
        hybrid = any(w is not None for w in model_config.windows)
        wanted = self.max_num_seqs * per_seq + hybrid  # no use for more (+1: a hybrid pool's null block)
        return max(1, min(wanted, kv_pool_blocks(model_config, budget, block_size=self.block_size, dtype=kv)))

    def resolve(self, model_config, dtype) -> "EngineConfig":
        """This config with every None sized for the model: num_blocks, max_waiting_tokens."""
        num_blocks = self.blocks_for(model_config, dtype)
        waiting = 4 * num_blocks * self.block_size if self.max_waiting_tokens is None else self.max_waiting_tokens
        return self.replace(num_blocks=num_blocks, max_waiting_tokens=waiting)

    def max_model_len(self, model_config) -> int:
        """Prompt + output tokens one sequence may hold: the model's context, or the whole pool (with
        windowed layers: what the global groups' tables can hold beside the windowed groups' windows
        and a chunk each, and the null block)."""
        if self.num_blocks is None:
            raise ValueError("max_model_len needs num_blocks: call resolve(model_config, dtype) first")
        groups, windows, glob = self._window_groups(model_config)
        if not windows:  # every layer global: a block per block_size tokens
            return min(model_config.max_positions, self.num_blocks * self.block_size)
        left = self.num_blocks - 1 - windows  # 1: the null block
        if glob == 0:  # every layer windowed: the pool bounds the window, not the context
            return model_config.max_positions if left >= 0 else 0
        return max(0, min(model_config.max_positions, left // glob * self.block_size))

    def _window_groups(self, model_config) -> tuple[list, int, int]:
        """(the layer groups as (window, count), the blocks the windowed groups hold -- each its window
        and one chunk -- and the number of global groups)."""
        _, groups = kv_layer_groups(model_config)
        bs, chunk = self.block_size, self.max_num_batched_tokens
        windows = sum(n * (-(-(w - 1 + chunk) // bs) + 1) for w, n in groups if w is not None)
        return groups, windows, sum(n for w, n in groups if w is None)

    def window_blocks(self, model_config) -> str | None:
        """Where the pool is too small for the windowed groups' own blocks (max_model_len 0), what they
        need, in words for an error; None otherwise."""
        groups, windows, glob = self._window_groups(model_config)
        bs, chunk = self.block_size, self.max_num_batched_tokens
        if not windows or self.num_blocks - 1 - windows >= (glob > 0):
            return None
        kinds = ", ".join(f"{n} group(s) of sliding-{w} layers" for w, n in groups if w is not None)
        return (
            f"{kinds} need {windows} blocks of {bs} tokens (each its window and one chunk of "
            f"max_num_batched_tokens={chunk}) plus the null block{' and one per global group' if glob else ''}: "
            f"give num_blocks >= {windows + 1 + glob} or a smaller max_num_batched_tokens"
        )


def is_quantized(model) -> bool:
    """Whether `model` computes with weights in a GGML format (headwise.load(..., weights="stored"),
    a GGUF as stored, weights="q4_0", ...): any of its linears a QuantizedLinear."""
    from ..models.linear import QuantizedLinear  # here, not at the top: this module imports no torch

    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def default_kv16() -> str:
    """The 16-bit K/V this CPU's decode kernels read fastest (DEFAULT_KV16 by the kernels' variant)."""
    from ..kernels import isa  # here: this module imports no torch

    return DEFAULT_KV16.get(isa(), "bfloat16")


def kv_dtype_for(kv_dtype: str | None, model) -> str | None:
    """The one place the K/V dtype is decided, for the engine and generate(): a given kv_dtype as it
    is ("float32": None, the model's dtype); None: default_kv16() for a quantized model (its weights are
    approximate already, and 16-bit K/V halve the bytes a long decode reads; the perplexity cost is
    in docs/kv-cache.md), the model's dtype (None) for any other. Returns a cache's kv_dtype."""
    if kv_dtype is None:
        return default_kv16() if is_quantized(model) else None
    kv = KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    return None if kv == "float32" else kv
