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

# The KV pool when neither num_blocks nor memory_budget_bytes is given: 1 GiB holds ~23k
# tokens of SmolLM2-135M in fp32 (46 KiB per token), 64 sequences of ~360 tokens; at most
# a quarter of the memory available when the engine is built.
DEFAULT_KV_BUDGET = 1 << 30
KV_DTYPES = (None, "int8", "bfloat16", "float16")
KV_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}


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
    kv_dtype: str | None = None  # None (the model's dtype), "bfloat16" / "float16" (half of fp32's
    # bytes) or "int8" (~1/4)
    max_waiting_requests: int = 256  # beyond this add_request raises QueueFull (a server's 429)
    max_waiting_tokens: int | None = None  # prompt tokens waiting; None = 4x what the KV pool holds
    memory_budget_bytes: int | None = None  # bytes for the pool when num_blocks is None (None: 1 GiB, at
    # most a quarter of the memory available)

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
                f"kv_dtype must be None (store K/V in the compute dtype), 'bfloat16', 'float16' or 'int8', "
                f"got {self.kv_dtype!r}"
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
        the model's ("float32")."""
        return self.kv_dtype if self.kv_dtype is not None else str(dtype).removeprefix("torch.")

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
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = 4 * DEFAULT_KV_BUDGET
        budget = min(DEFAULT_KV_BUDGET, available // 4)
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
