"""`Step`: what one forward step runs over, the per-step metadata a model gets (vLLM's attention metadata).

Every call of a decoder model is `model(input_ids, step)`: a prefill, a decode, a ragged batch,
a chunk of a long prompt, the engine's packed mix of prefill chunks and decodes. The step says,
for the B x T input tokens:

    input_positions   (B, T) long   absolute position of each token (RoPE, learned positions)
    layer(i)          the LayerKVCache layer i writes its K/V to and attends through, or None
                      (no cache: the T tokens attend to each other only)
    num_real          (B,) long or None: real tokens per row when rows are right-padded (the
                      padding is not kept by the cache); None = all T are real
    key_padding_mask  (B, T) bool or None: padded tokens (True) of a forward without a cache
    logits_indices    (R,) long (or a list of R ints) or None: flat rows b * T + t whose logits
                      are wanted, in that order; the model then returns (R, V) and runs its output
                      layer (~20% of SmolLM2's weights per row) on those rows only. None = every
                      row, (B, T, V).

Each cache kind produces its steps: `ContiguousKVCache.step(T, num_new)` (a row per sequence;
sliding and int8 caches alike), `PagedKVCache.batch(...)` (padded rows over block tables) and
`PagedKVCache.packed(...)` (sequences packed on one axis, B = 1). A model never branches on
the cache's type; it reads these fields. Derived tensors that every layer needs (RoPE's cos/sin,
the few-rows route's rotation matrices) are made once per step and memoized here.

    step = cache.step(T)                                    # after earlier steps filled the cache
    logits = model(input_ids, step)                         # (B, T, V)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .rope import RotaryEmbedding


class Step:
    """Per-step metadata; see the module docstring. Subclasses (cache steps) set the fields."""

    input_positions: Tensor
    num_real: Tensor | None = None
    key_padding_mask: Tensor | None = None
    logits_indices: Tensor | None = None
    claim_stack = None  # a cache's claim_decode_stack (CacheStep)
    # Where the step knows its positions on the host, for RoPE rows from a table: every row's T
    # positions from one start, (L, B, T); or the largest position of any row.
    positions_run: tuple[int, int, int] | None = None
    max_position: int | None = None
    # `memo`'s dict, made on first use; a step lives one forward, so nothing invalidates it.
    # (Declared here with a default: subclasses set their fields without calling an __init__.)
    _memo: dict | None = None
    # Whether logits_indices has been checked against this step's (B, T) (make_step, once).
    _indices_checked: bool = False

    def layer(self, i: int):
        """Layer i's cache (a `LayerKVCache`), or None for a step without a cache."""
        return None

    @property
    def memo(self) -> dict:
        """Tensors derived from the step and shared by its layers (cos/sin, rotations)."""
        m = self._memo
        if m is None:
            m = self._memo = {}
        return m

    def rope_cos_sin(self, rope) -> tuple[Tensor, Tensor]:
        """rope.cos_sin(input_positions), once per step and rope module."""
        key = ("cos_sin", id(rope))
        cs = self.memo.get(key)
        if cs is None:
            cs = self.memo[key] = rope.cos_sin(self.input_positions)
        return cs

    def rope_rows(self, rope) -> tuple[Tensor, Tensor]:
        """cos and sin (B*T, dim/2) contiguous fp32, row b*T + t at input_positions[b, t]: the
        tables for a kernel that rotates a flat batch of rows (kernels.small_linear's rope), once
        per step and rope module."""
        key = ("rows", id(rope))
        rows = self.memo.get(key)
        if rows is None and type(rope).cos_sin is RotaryEmbedding.cos_sin:
            rows = self.memo[key] = self._table_rows(rope)
        if rows is None:
            B, T = self.input_positions.shape
            cos, sin = self.rope_cos_sin(rope)  # (B|1, 1, T, dim/2)
            rows = self.memo[key] = tuple(
                t.expand(B, 1, T, t.shape[-1]).reshape(B * T, -1).contiguous() for t in (cos, sin)
            )
        return rows

    def _table_rows(self, rope) -> tuple[Tensor, Tensor] | None:
        """rope_rows from RotaryEmbedding.table (positions known on the host): a decode step of
        one sequence takes two views, any other two copies, where cos_sin takes eight ops."""
        run = self.positions_run
        if run is not None:
            L, B, T = run
            cos, sin = rope.table(L + T)
            cos, sin = cos[L : L + T], sin[L : L + T]
            return (cos, sin) if B == 1 else (cos.repeat(B, 1), sin.repeat(B, 1))
        if self.max_position is not None:
            cos, sin = rope.table(self.max_position + 1)
            pos = self.input_positions.reshape(-1)
            return cos.index_select(0, pos), sin.index_select(0, pos)
        return None


class PlainStep(Step):
    """A forward without a cache: positions 0..T-1 (whatever the padding, as HF without
    position_ids); key_padding_mask marks padded tokens."""

    def __init__(
        self, B: int, T: int, device, key_padding_mask: Tensor | None = None, logits_indices: Tensor | None = None
    ):
        self.B, self.T = B, T
        self.input_positions = torch.arange(T, device=device)[None].expand(B, T)  # (B, T)
        self.key_padding_mask, self.logits_indices = key_padding_mask, logits_indices


class CacheStep(Step):
    """A step over a cache of one tensor per layer (contiguous, sliding, int8): row b of the
    batch is sequence b; its T new tokens follow what the cache holds. `layers(i)` gives
    layer i's cache; positions are layer 0's (every layer agrees at the start of a step).
    claim_stack: the cache's claim_decode_stack where it has one, for a decode step whose layers
    run in one kernel call (models/layer_step.py)."""

    def __init__(
        self,
        layers: Callable[[int], object],
        T: int,
        num_real: Tensor | None = None,
        logits_indices: Tensor | None = None,
        claim_stack: Callable[[int, int], tuple | None] | None = None,
    ):
        self._layers, self.T, self.claim_stack = layers, T, claim_stack
        first = layers(0)
        run = getattr(first, "positions_run", None)
        self.positions_run = None if run is None else run(T)
        if self.positions_run is None:
            self._positions = first.positions(T)  # (B, T)
            self.B = self._positions.shape[0]
        else:  # made when asked: a decode step on the stack reads its RoPE rows from the table
            self._positions, self.B, self._device = None, self.positions_run[1], first.device
        self.num_real, self.logits_indices = num_real, logits_indices

    @property
    def input_positions(self) -> Tensor:
        """(B, T) long: the positions as the cache gave them when the step was made."""
        p = self._positions
        if p is None:
            L, B, T = self.positions_run
            p = self._positions = torch.arange(L, L + T, device=self._device).expand(B, T)
        return p

    def layer(self, i: int):
        return self._layers(i)


def right_padding_lengths(key_padding_mask: Tensor, B: int, T: int) -> Tensor:
    """(B,) real-token counts from a right-padded (B, T) mask (True = padding)."""
    if tuple(key_padding_mask.shape) != (B, T):
        raise ValueError(
            f"with a cache, the padding mask marks padding among the new tokens and must be "
            f"(B, T) = ({B}, {T}), got {tuple(key_padding_mask.shape)}"
        )
    num_new = (~key_padding_mask).sum(dim=1)
    expected = torch.arange(T, device=key_padding_mask.device)[None, :] >= num_new[:, None]
    if not torch.equal(expected, key_padding_mask):
        raise ValueError(
            "with a cache, padding among the new tokens must be on the right (each row: real tokens, then padding)"
        )
    return num_new


def check_logits_indices(idx, B: int, T: int, device) -> Tensor | None:
    """(R,) long flat rows in [0, B*T), or None. A list or tuple of ints (what the engine's runner
    builds) is checked in Python: no tensor reductions and no syncs in the step."""
    if idx is None:
        return None
    if isinstance(idx, (list, tuple)) and all(type(i) is int for i in idx):
        if not idx:
            raise ValueError("logits_indices must be a non-empty list of row indices b * T + t, got []")
        lo, hi = min(idx), max(idx)
        rows = torch.tensor(idx, dtype=torch.long, device=device)
    else:
        idx = torch.as_tensor(idx, device=device)
        if idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool or idx.numel() == 0:
            raise ValueError(
                f"logits_indices must be a non-empty 1-D tensor of row indices b * T + t, "
                f"got {tuple(idx.shape)} {idx.dtype}"
            )
        lo, hi = int(idx.min()), int(idx.max())
        rows = idx.long()
    if lo < 0 or hi >= B * T:
        raise ValueError(f"logits_indices must be in [0, B*T = {B * T}) for B={B}, T={T}; got values in [{lo}, {hi}]")
    return rows


def padding_mask(attention_mask: Tensor | None, B: int, T: int) -> Tensor | None:
    """HF's attention_mask (B, T), 1 = token and 0 = padding -> key_padding_mask, True = padding."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(
            f"attention_mask must be (B, T) = ({B}, {T}) like input_ids, got {tuple(attention_mask.shape)}"
        )
    return attention_mask == 0


def make_step(step: Step | None, cache, attention_mask: Tensor | None, B: int, T: int, device) -> Step:
    """The step a model runs: `step` as given, or the one the older keywords describe
    (`cache=`: a multi-layer cache, or a paged step; attention_mask (B, T): 1 = token, 0 = padding)."""
    if step is not None and cache is not None:
        raise ValueError("pass either a step (model(input_ids, step)) or cache=, not both")
    if step is None and isinstance(cache, Step):
        step, cache = cache, None
    if step is not None:
        if not isinstance(step, Step):
            raise TypeError(
                f"step must be a headwise Step (from cache.step(T), cache.batch(...), cache.packed(...)), "
                f"got {type(step).__name__}; a cache goes in cache="
            )
        if attention_mask is not None:
            raise ValueError(
                "attention_mask with a step: the step already says which tokens are real "
                "(cache.step(T, num_new=...), or the counts of cache.batch/packed)"
            )
        B_s, T_s = step.input_positions.shape
        if (B_s, T_s) != (B, T):
            raise ValueError(f"input_ids is (B, T) = ({B}, {T}) but the step is for ({B_s}, {T_s}) tokens")
        if step.logits_indices is not None and not step._indices_checked:
            step.logits_indices = check_logits_indices(step.logits_indices, B, T, device)
            step._indices_checked = True
        return step
    kpm = padding_mask(attention_mask, B, T)
    if cache is None:
        return PlainStep(B, T, device, kpm)
    num_real = None if kpm is None else right_padding_lengths(kpm, B, T)
    if hasattr(cache, "step"):
        return cache.step(T, num_real)
    if not hasattr(cache, "layer"):
        raise TypeError(
            f"cache= takes a multi-layer cache (with .layer(i)) or a paged step, got {type(cache).__name__}"
        )
    return CacheStep(cache.layer, T, num_real)
