"""Paged KV cache: block tables over one shared pool of fixed-size blocks (vLLM's PagedAttention).

Every sequence owns a block table, a list of block ids; token p of a sequence lives
in slot p % block_size of block table[p // block_size], in every layer. The pool
(block_pool.py) keeps the free lists, reference counts and prefix table, so that
forks share blocks copy-on-write and a prompt prefix computed once is reused.

    cache = PagedKVCache(num_layers, Hkv, D, num_blocks)
    n = cache.add_sequence("a", prompt)       # n leading tokens already cached (prefix hit)
    step = cache.batch(["a"], num_new=[len(prompt) - n], token_ids=[prompt[n:]])
    logits = model(input_ids, step)            # (or one layer: attn(x, cache=step.layer(i), is_causal=True))
    step = cache.batch(["a"])                                      # then one token per decode step

A step reserves every slot it needs up front (all or nothing: `CacheFull` before
anything changes), so a model never fails half way through its layers.

Storage layout, and how blocks are read (views, tile gathers) and written: paged_store.py.
How steps read the blocks, with measurements: paged_step.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from .block_pool import BlockPool, CacheFull, prefix_key  # noqa: F401  (CacheFull re-exported)
from .packed import PackedStep
from .paged_step import PagedLayerStep, PagedRead, PagedStep  # noqa: F401  (re-exported: the step classes)
from .paged_reserve import Reservations
from .paged_store import TILE_TOKENS, PagedStorage
from .quantized import kv_kind


class UnknownSequence(KeyError):
    """A sequence id the cache does not hold."""

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    hashes: list[int] = field(default_factory=list)  # chain hash of each full block whose tokens we know
    partial: list[int] = field(default_factory=list)  # token ids after the last hashed block
    hashable: bool = True  # every token so far came with its id
    dropped: int = 0  # a windowed cache's: entries before this one fell out of the window (null block)

    def copy(self) -> "_Seq":
        return _Seq(list(self.blocks), self.length, list(self.hashes), list(self.partial), self.hashable, self.dropped)


class PagedKVCache(Reservations, PagedStorage):
    """K/V for `num_layers` layers in `num_blocks` blocks of `block_size` tokens.

    Args:
        dtype: the compute dtype K/V arrive and are read in.
        kv_dtype: None (store `dtype`), "bfloat16" / "float16" (16 bits, rounded to nearest even; the
            C decode kernels read them as stored) or "int8" (int8 + fp32 scale per (token, head)).
        tile_tokens: keys per gathered tile when reading (a multiple of block_size).
        spread: start each new run of blocks in the middle of the largest free stretch
            (`BlockPool.allocate`), so that many sequences growing side by side each stay
            one consecutive run, read as a view (what a serving engine wants).
        region_blocks: start each new sequence at the start of a free region of this many
            blocks when there is one (`BlockPool.allocate`); a packed step then reads the
            decodes of such sequences as one strided view (packed.py).
        window: every layer of this cache sees the `window` keys ending at each query; blocks
            that fall out of it go back to the pool (paged_reserve.py). A hybrid cache (hybrid.py)
            builds one such cache per group of layers, over one `pool` and one `storage`.
        pool, storage: a BlockPool and a PagedKVCache whose block pool and K/V planes this cache
            shares (the groups of a hybrid cache; block ids are the pool's, so they never clash).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
        *,
        tile_tokens: int = TILE_TOKENS,
        spread: bool = False,
        region_blocks: int | None = None,
        window: int | None = None,
        pool: BlockPool | None = None,
        storage: PagedStorage | None = None,
    ):
        for name, val in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("tile_tokens", tile_tokens),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not dtype.is_floating_point:
            raise TypeError(
                f"dtype is the compute dtype of K/V and must be floating point, got {dtype}; "
                f"for an int8 cache pass kv_dtype='int8'"
            )
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.kv_dtype = kv_kind(kv_dtype)
        self.tile_blocks = max(1, tile_tokens // block_size)
        self.spread = bool(spread)
        if region_blocks is not None and (not isinstance(region_blocks, int) or not 1 <= region_blocks <= num_blocks):
            raise ValueError(
                f"region_blocks must be None or an int in [1, num_blocks={num_blocks}], got {region_blocks!r}"
            )
        self.region_blocks = region_blocks
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be None (every key) or an int >= 1, got {window!r}")
        self.window = window
        self.pool = BlockPool(num_blocks, block_size) if pool is None else pool
        if storage is None:
            self._allocate_storage(num_blocks)  # self._k, self._v, self._scratch (paged_store.py)
        else:
            self._share_storage(storage)
        self._seqs: dict[Hashable, _Seq] = {}
        # Who hears of each change of which block holds what, once it is made: None, or a callable
        # taking (op, *args, **kwargs) as the call was made -- add_sequence, fork, free, packed
        # (with the step it returned before its arguments) and "commit" (a packed step's). Tensor
        # parallelism's rank 0 sets it, so its followers replay the pool's calls in order.
        self.journal: Callable[..., None] | None = None

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> int:
        """Register a new, empty sequence. With `token_ids` (its prompt), the longest run of
        full leading blocks found in the prefix table is shared instead of recomputed, and
        the number of tokens so cached is returned (a multiple of block_size). At least
        the last prompt token is always left to compute, since its logits are needed.
        The caller then passes the remaining tokens, token_ids[n:], to `batch`."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or pick a new id")
        seq = _Seq()
        if token_ids is not None:
            toks = [int(t) for t in token_ids]
            bs, parent = self.block_size, self.prefix_root
            for i in range((len(toks) - 1) // bs if toks else 0):
                key = prefix_key(parent, toks[i * bs : (i + 1) * bs])
                block = self.pool.lookup(key)
                if block is None:
                    break
                self.pool.share(block)
                parent = hash(key)
                seq.blocks.append(block)
                seq.hashes.append(parent)
            seq.length = len(seq.blocks) * bs
        self._seqs[seq_id] = seq
        if self.journal is not None:
            self.journal("add_sequence", seq_id, token_ids)
        return seq.length

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> None:
        """`new_seq_id` starts as a copy of `seq_id`, sharing every block; the first append
        to a shared, partly filled block copies it (copy-on-write)."""
        src = self._seq(seq_id)
        if new_seq_id in self._seqs:
            raise ValueError(f"cannot fork {seq_id!r} into {new_seq_id!r}: that sequence already exists")
        for b in src.blocks[src.dropped :]:
            self.pool.share(b)
        self._seqs[new_seq_id] = src.copy()
        if self.journal is not None:
            self.journal("fork", seq_id, new_seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence. Its blocks return to the pool; full blocks with a known prefix stay
        findable by `add_sequence` until the pool reuses them. Last blocks go first (they are
        the least likely to be shared), so the front of a prefix is evicted last."""
        seq = self._seq(seq_id)
        for b in reversed(seq.blocks[seq.dropped :]):
            self.pool.release(b)
        del self._seqs[seq_id]
        if self.journal is not None:
            self.journal("free", seq_id)

    def truncate(self, seq_id: Hashable, length: int, token_ids: Sequence[int] | None = None) -> None:
        """Keep the first `length` tokens of `seq_id` and drop the rest (the K/V of draft tokens a
        speculative step computed and rejected, runtime/predict.py): blocks past the new end go
        back to the pool and the slots after it are written again by the next step. token_ids:
        the sequence's ids (at least its first `length`), to keep its prefix hashes going; without
        them, blocks it fills from here on are not findable by prefix. Blocks holding dropped
        tokens become unfindable by prefix, as their slots will be overwritten."""
        seq, bs = self._seq(seq_id), self.block_size
        if self.window is not None:
            raise ValueError("truncate does not run on a windowed cache (blocks out of the window are gone)")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= seq.length:
            raise ValueError(f"truncate length must be an int in [0, {seq.length}] for {seq_id!r}, got {length!r}")
        if length == seq.length:
            return
        keep, full = -(-length // bs), length // bs
        for b in seq.blocks[full:]:  # written past the new end: their keys would name the dropped tokens
            self.pool.forget(b)
        for b in reversed(seq.blocks[keep:]):
            self.pool.release(b)
        del seq.blocks[keep:]
        seq.length = length
        if seq.hashable and token_ids is not None and len(token_ids) >= length and len(seq.hashes) >= full:
            del seq.hashes[full:]
            seq.partial = [int(t) for t in token_ids[full * bs : length]]
        else:
            seq.hashable, seq.partial = False, []
        if self.journal is not None:
            self.journal("truncate", seq_id, length, None if token_ids is None else list(token_ids[:length]))

    def blocks_needed(self, seq_id: Hashable, num_new: int) -> int:
        """Free blocks that appending `num_new` tokens to `seq_id` takes (copy-on-write included)."""
        return self._needed([self._seq(seq_id)], [self._count(num_new, seq_id)])

    def can_allocate(self, seq_id: Hashable, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= self.pool.num_free

    def length(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            held = list(self._seqs)
            shown = ", ".join(map(repr, held[:8])) + (", ..." if len(held) > 8 else "")
            raise UnknownSequence(
                f"unknown sequence id {seq_id!r}: the cache holds {len(held)} "
                f"sequence(s) [{shown}]; call add_sequence first"
            ) from None

    @staticmethod
    def _count(n, seq_id) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_new for sequence {seq_id!r} must be an int >= 0, got {n!r}")
        return n

    # ------------------------------------------------------------------ a step
    def batch(
        self,
        seq_ids: Sequence[Hashable],
        num_new: int | Sequence[int] = 1,
        token_ids: Sequence[Sequence[int] | None] | None = None,
        *,
        logits_indices=None,
    ) -> "PagedStep":
        """Reserve slots for the next tokens of each listed sequence and return the step that
        the model's layers read and write through (`step.layer(i)`).

        num_new: tokens per sequence (int: the same for all). The layers get K/V
            (B, Hkv, T, D) with T = max(num_new), each sequence's tokens first (right padding).
        token_ids: each sequence's new token ids (or None), so that blocks they fill become
            findable by prefix. They are registered once every layer of the step has written.
        logits_indices: flat rows b * T + t whose logits the model should return (a `Step` field).
        Raises CacheFull, changing nothing, when the batch needs more blocks than are free.
        Lengths advance here, so every layer of the step must write (`step.layer(i).update`)
        before these sequences are read again; a step abandoned half way leaves its slots
        unwritten, and its sequences should be freed.
        """
        seq_ids, tables, starts, counts, pending = self._reserve(seq_ids, num_new, token_ids, "batch")
        return PagedStep(self, seq_ids, tables, starts, counts, pending, logits_indices=logits_indices)

    def packed(
        self,
        seq_ids: Sequence[Hashable],
        num_new: Sequence[int],
        token_ids: Sequence[Sequence[int] | None] | None = None,
        *,
        defer_prefix: bool = False,
        logits_indices=None,
        as_rows: bool = False,
    ):
        """Like `batch`, but the step's tokens are packed on one axis, with no padding: the
        model gets input_ids (1, N), N = sum(num_new), sequence 0's new tokens first, and
        each layer k, v (1, Hkv, N, D) (see packed.py). Decodes (1 token) and prefill
        chunks (many) of different lengths then share every projection and MLP matmul.

        defer_prefix: full blocks become findable by prefix only at `step.commit()`, not
        from inside the last layer's write, so that a caller (the engine) can keep all
        pool bookkeeping on one thread while the forward runs on another.
        logits_indices: pack rows whose logits the model should return (the engine: the last
        row of each sequence that samples a token), a `Step` field.
        as_rows: each new token may run as a decode row of its sequence (a decode with draft
        tokens, runtime/predict.py): the decode stack then takes the step (packed.py decode_rows).
        """
        ids, tables, starts, counts, pending = self._reserve(seq_ids, num_new, token_ids, "packed")
        step = PackedStep(
            self,
            ids,
            tables,
            starts,
            counts,
            pending,
            defer_prefix=defer_prefix,
            logits_indices=logits_indices,
            as_rows=as_rows,
        )
        if self.journal is not None:
            self.journal(
                "packed",
                step,
                ids,
                num_new,
                token_ids,
                defer_prefix=defer_prefix,
                logits_indices=logits_indices,
                as_rows=as_rows,
            )
        return step

    def _read_plan(self, seq_ids, tables, starts, counts) -> "PagedStep":
        """A read plan only (no writes): for the parts of a packed step, which writes for them."""
        return PagedStep(self, seq_ids, tables, starts, counts, [], write=False)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"dtype={self.dtype}, kv_dtype={self.kv_dtype}, sequences={len(self._seqs)}, "
            f"free_blocks={self.num_free_blocks})"
        )
