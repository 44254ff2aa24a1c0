"""Linears and embeddings that keep their weight as GGML blocks and compute from them.

    lin = QuantizedLinear(576, 1536, "q4_1", blocks=blocks)   # blocks (1536, 360) uint8
    y = lin(x)                                                 # x (..., 576) -> (..., 1536)

A row of the weight is `in_features / block` blocks of a GGML format (ggml-common.h:
block_q4_0, block_q4_1, block_q8_0, block_q4_K, block_q6_K), exactly as a GGUF file stores
it, so a quantized file loads with one copy of each weight and no fp32 parameter. Rows are
independent: permuting rows (llama.cpp's Q/K order) or stacking them (fused QKV) works on the
blocks directly.

Forwards of up to kernels.KERNEL_ROWS rows (decode steps) go to headwise.kernels.quant's integer
kernel (activations quantized per block on the fly, as llama.cpp's vec_dot does), where it runs; so
do prefills of packed weights where our kernels beat oneDNN (every CPU measured:
kernels.KERNELS_OVER_ONEDNN), KERNEL_ROWS rows at a time; other forwards (prefill, or no kernel)
dequantize the weight into a temporary and call F.linear, so no fp32 copy outlives the call. The
dequantization is the kernel's where it runs, else models/quants.py's torch decoders (bit-exact with
the gguf package). That F.linear first rounds x the way the kernel does (`round_activations`), so
both routes compute the same function up to fp32 summation order: a row's result does not depend on
how many rows share its step (the engine's chunked prefill vs generate's whole prompt), and a
machine without the kernel gets the same numbers.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..core.formats import PACKABLE, QUANT_FORMATS
from . import quants
from .fused_ops import composed, kernel_args

FORMATS = QUANT_FORMATS  # name -> (ggml type id, values per block, bytes per block): headwise/core/formats.py
FORMAT_OF_GGML = {ggml: name for name, (ggml, _, _) in FORMATS.items()}


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one row of `in_features` values in `fmt`; in_features must be whole blocks."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; formats: {', '.join(FORMATS)}")
    _, block, nbytes = FORMATS[fmt]
    if in_features % block:
        raise ValueError(f"{fmt} stores rows in blocks of {block} values; in_features={in_features} is not a multiple")
    return in_features // block * nbytes


@functools.cache
def _quant_module():
    """headwise.kernels.quant, or None where it is not importable (not built, or an older tree)."""
    try:
        from ..kernels import quant
    except ImportError:
        return None
    return quant


@functools.cache  # asked ~120 times a decode step; the answer is fixed for the process
def kernel_unavailable(fmt: str) -> str | None:
    """None when the quantized matmul kernel runs `fmt` here, else why not."""
    quant = _quant_module()
    if quant is None:
        return "headwise.kernels.quant cannot be imported (the compiled extension lacks it)"
    return quant.quant_unavailable(fmt)


def dequantize(
    blocks: Tensor, fmt: str, out_features: int, in_features: int, out: Tensor | None = None, *, packed: bool = False
) -> Tensor:
    """(O, row_bytes) uint8 blocks (packed: kernels.quant.pack_rows' groups of 8 rows) -> (O, I)
    fp32, into `out` where given (the kernel only) else a new tensor."""
    quant = _quant_module()
    if packed or out is not None or (quant is not None and quant.quant_unavailable(fmt) is None):
        return quant.dequantize(blocks, fmt, out_features, in_features, out, packed=packed)
    _, _, nbytes = FORMATS[fmt]
    decode = quants.KERNELS[FORMATS[fmt][0]][2]
    return decode(blocks.reshape(-1, nbytes)).reshape(out_features, in_features)


def quantize(weight: Tensor, fmt: str) -> Tensor:
    """(O, I) float weight -> (O, row_bytes) uint8 blocks of `fmt`, rounded as llama.cpp's
    reference quantizer rounds (the kernel's quantize, else gguf.quants' numpy one)."""
    O, I = weight.shape
    row_bytes(fmt, I)  # checks the format and the block fit
    w = weight.detach().float().contiguous()
    quant = _quant_module()
    if quant is not None and quant.quant_unavailable(fmt) is None:
        return quant.quantize(w, fmt)
    import gguf

    try:
        out = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(FORMATS[fmt][0]))
    except NotImplementedError:
        raise ValueError(
            f"no quantizer for {fmt} here (gguf.quants has none and headwise.kernels.quant is unavailable); "
            "requantize to q8_0, q4_0, q4_1 or q5_0"
        ) from None
    return torch.from_numpy(np.ascontiguousarray(out).view(np.uint8)).reshape(O, -1)


ACT_BLOCK = 32  # kernels.quant rounds x to int8 per 32 values, for every weight format
# A prefill dequantizes its weight a tile of output rows at a time into a per-thread buffer of
# this many values (4 MiB): a fresh (O, I) fp32 tensor costs more in page faults than decoding
# it (SmolLM2's 49152 x 576 head: 167 ms fresh vs 16 ms into a buffer), and no whole fp32
# weight is ever held, even for a moment.
TILE_VALUES = 1 << 20
_tiles = threading.local()


def _tile(values: int) -> Tensor:
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.numel() < values:
        buf = _tiles.buf = torch.empty(max(values, TILE_VALUES))
    return buf[:values]


def round_activations(x: Tensor) -> Tensor:
    """x (..., I) rounded as kernels.quant rounds it: per 32 values d = amax / 127 and
    q = round-half-even(x * (1 / d)) in fp32, giving q * d. Gradients pass straight through."""
    xb = x.float().reshape(*x.shape[:-1], -1, ACT_BLOCK)
    d = xb.abs().amax(-1, keepdim=True).div_(127)
    xq = (xb * torch.where(d == 0, 0, 1 / d)).round_().mul_(d).reshape(x.shape).to(x.dtype)
    return x + (xq - x).detach() if x.requires_grad else xq


def _blocks_buffer(
    out_features: int, in_features: int, fmt: str, blocks: Tensor | None, device, packed: bool = False
) -> Tensor:
    nbytes = row_bytes(fmt, in_features)
    shape = (-(-out_features // 8), 8 * nbytes) if packed else (out_features, nbytes)
    if blocks is None:
        return torch.empty(shape, dtype=torch.uint8, device=device)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != shape:
        raise ValueError(
            f"{fmt} {'packed ' if packed else ''}blocks for a ({out_features}, {in_features}) weight must be uint8 {shape}, "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    return blocks


class QuantizedLinear(nn.Module):
    """y = round_activations(x) W^T + b with W kept as GGML blocks (`blocks` buffer,
    (O, row_bytes) uint8): nn.Linear's function, x rounded to int8 per 32 values as llama.cpp does.

    No gradients flow to W (it is integers); the bias, an fp32 Parameter, is trainable.
    `.weight` is a dequantized *copy* for code that inspects weights; edit `blocks` instead.
    packed: `blocks` holds the same bytes in kernels.quant.pack_rows' groups of 8 rows,
    (ceil(O / 8), 8 row_bytes), which its kernel reads ~2x faster at 1-2 rows (`pack`)."""

    _plan = None
    _plan_key: tuple | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        bias: bool = False,
        *,
        blocks: Tensor | None = None,
        device=None,
        packed: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.packed = in_features, out_features, fmt, packed
        self.register_buffer("blocks", _blocks_buffer(out_features, in_features, fmt, blocks, device, packed))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def tied_to(cls, embedding: "QuantizedEmbedding") -> "QuantizedLinear":
        """An output head (V, C) that reads the embedding's blocks: one buffer for both."""
        V, C = embedding.num_embeddings, embedding.embedding_dim
        return cls(C, V, embedding.fmt, blocks=embedding.blocks, packed=embedding.packed)

    def pack(self) -> bool:
        """Re-lay `blocks` in groups of 8 rows where the kernel has that layout (q4_0, q4_1,
        q8_0) and runs; the old buffer is freed (one copy). Returns whether it packed."""
        if not _can_pack(self):
            return False
        self.blocks = _quant_module().pack_rows(self.blocks, self.fmt, self.out_features, self.in_features)
        self.packed, self._plan_key = True, None
        return True

    def file_blocks(self) -> Tensor:
        """The blocks in the file's (O, row_bytes) layout (a copy when packed)."""
        if not self.packed:
            return self.blocks
        return _quant_module().unpack_rows(self.blocks, self.fmt, self.out_features, self.in_features)

    @property
    def weight(self) -> Tensor:
        """(O, I) fp32, dequantized now: a copy, not a view (writing to it changes nothing)."""
        return dequantize(self.blocks, self.fmt, self.out_features, self.in_features, packed=self.packed)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight (the blocks; the bias is not counted)."""
        return self.blocks.numel()

    def kernel_plan(self):
        """kernels.quant's plan of the blocks and bias, remade when either is replaced."""
        b = self.bias
        key = (self.blocks.data_ptr(), None if b is None else b.data_ptr())
        if key != self._plan_key:
            quant = _quant_module()
            self._plan = quant.plan_quant(
                self.blocks, self.fmt, self.out_features, self.in_features, b, packed=self.packed
            )
            self._plan_key = key
        return self._plan

    def route_plan(self, x: Tensor):
        """The kernel plan when x (N, in) goes to the quantized kernel from the decoder block's
        few-rows route (which has checked grad mode and tracing), else None: as
        PackedLinear.route_plan."""
        if self._kernel_takes(x):
            return self.kernel_plan()
        return None

    def stack_plan(self):
        """kernel_plan() for the C layer stack (models/layer_step.py), None where its kernel cannot run."""
        ok = self.blocks.is_cpu and (self.bias is None or self.bias.dtype is torch.float32)
        return self.kernel_plan() if ok and kernel_unavailable(self.fmt) is None else None

    kernel_rows = staticmethod(lambda: kernels.KERNEL_ROWS)  # the most rows stack_plan's kernel takes at once

    def _kernel_takes(self, x: Tensor) -> bool:
        return (
            x.is_cpu
            and x.dtype is torch.float32
            and x.is_contiguous()
            and x.numel() <= kernels.KERNEL_ROWS * x.shape[-1]
            and self.blocks.is_cpu
            and (self.bias is None or self.bias.dtype is torch.float32)
            and kernel_unavailable(self.fmt) is None
        )

    @staticmethod
    def run(plan, x: Tensor, **epilogue) -> Tensor:
        """kernels.quant.run_quant with route_plan's plan."""
        return _quant_module().run_quant(plan, x, **epilogue)

    def fused_forward(self, x: Tensor, *, residual=None, norm=None, swiglu=False, rope=None) -> Tensor:
        """fused_ops.fused_linear: one kernel call where route_plan allows, else composed."""
        plan = self.route_plan(x)
        if plan is None:
            return composed(self, x, residual=residual, norm=norm, swiglu=swiglu, rope=rope)
        x, epilogue = kernel_args(x, norm, swiglu, rope)
        return self.run(plan, x, residual=residual, **epilogue)

    def forward(self, x: Tensor) -> Tensor:
        if (
            not torch.compiler.is_compiling()
            and not (
                torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
            )
            and self._kernel_takes(x)
        ):
            return self.run(self.kernel_plan(), x)
        if (
            x.dtype is torch.float32
            and x.is_cpu
            and not torch.is_grad_enabled()
            and kernel_unavailable(self.fmt) is None
        ):
            if self.packed and kernels.KERNELS_OVER_ONEDNN and x.is_contiguous():
                return self._chunked(x)
            return self._tiled(x)
        w = self.weight  # a temporary: prefill dequantizes per call rather than keep fp32 weights
        return F.linear(round_activations(x), w if x.dtype is torch.float32 else w.to(x.dtype), self.bias)

    def _chunked(self, x: Tensor) -> Tensor:
        """Many rows where our kernels beat oneDNN's (kernels.KERNELS_OVER_ONEDNN): the integer
        kernel KERNEL_ROWS rows at a time. On AMD EPYC Zen 3 (1 thread, Q4_1 packed, 128 rows of
        576 or 1536) it took 0.65x the time of dequantizing a tile + MKL's fp32 GEMM (~45 GMAC/s
        there); SmolLM2's 512-token prefill ran at 769 vs 472 tok/s on Zen 4 (AVX-512) and 1181
        vs 872 on an Intel Xeon (AVX-512 + AMX), whose wider GEMM was expected to win."""
        I = self.in_features
        xs = x.reshape(-1, I)  # (N, I)
        plan, run, R = self.kernel_plan(), _quant_module().run_quant, kernels.KERNEL_ROWS
        y = torch.cat([run(plan, xs[i : i + R]) for i in range(0, xs.shape[0], R)])  # (N, O)
        return y.view(*x.shape[:-1], self.out_features)

    def _tiled(self, x: Tensor) -> Tensor:
        """Many rows, no grad: y = x_q W^T a tile of output rows at a time, each tile dequantized
        into the per-thread buffer just before its GEMM."""
        O, I = self.out_features, self.in_features
        xq = round_activations(x).reshape(-1, I)  # (N, I)
        rows = max(8, min(O, TILE_VALUES // I) // 8 * 8)  # whole groups of 8 rows when packed
        quant = _quant_module()
        y = torch.empty(xq.shape[0], O)  # (N, O)
        for o in range(0, O, rows):
            n = min(rows, O - o)
            part = self.blocks[o // 8 : o // 8 + -(-n // 8)] if self.packed else self.blocks[o : o + n]
            w = quant.dequantize(part, self.fmt, n, I, out=_tile(n * I).view(n, I), packed=self.packed)
            torch.mm(xq, w.t(), out=y[:, o : o + n])
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], O)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"bias={self.bias is not None}"
        )


class Embedding(nn.Embedding):
    """nn.Embedding that skips its random init on the meta device, where loading builds models:
    torch's normal_ on a meta tensor runs through its Python decompositions, whose first use
    imports ~1.5-4 s of modules per process (measured: 4.2 s on a busy 2-core machine) to
    initialise values that the checkpoint then replaces."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over GGML blocks (`blocks` (V, row_bytes) uint8): a lookup dequantizes only the rows it gathers."""

    packed = False  # blocks in groups of 8 rows (QuantizedLinear.pack), for a tied head's kernel

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str, *, blocks: Tensor | None = None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        self.register_buffer("blocks", _blocks_buffer(num_embeddings, embedding_dim, fmt, blocks, device))

    # the same attributes as QuantizedLinear's, so that pack / file_blocks serve both
    out_features = property(lambda self: self.num_embeddings)
    in_features = property(lambda self: self.embedding_dim)
    pack, file_blocks = QuantizedLinear.pack, QuantizedLinear.file_blocks
    _plan_key = None

    @property
    def weight(self) -> Tensor:
        """(V, C) fp32, dequantized now: a copy, not a view."""
        return dequantize(self.blocks, self.fmt, self.num_embeddings, self.embedding_dim, packed=self.packed)

    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, ids: Tensor) -> Tensor:
        flat, C = ids.reshape(-1), self.embedding_dim
        if self.packed and flat.shape[0] == 1:  # a decode step of one sequence: 3 ops where the rows' way takes 7
            i = int(flat[0])
            if not 0 <= i < self.num_embeddings:
                raise IndexError(f"token id {i} is out of range for an embedding of {self.num_embeddings} rows")
            group = dequantize(self.blocks[i // 8 : i // 8 + 1], self.fmt, 8, C, packed=True)  # (8, C)
            return group[i % 8].view(*ids.shape, C)
        if self.packed:  # dequantize each id's group of 8 rows, keep its row
            groups = self.blocks.index_select(0, flat // 8)  # (N, 8 row_bytes)
            rows = dequantize(groups, self.fmt, 8 * len(flat), C, packed=True).view(-1, 8, C)
            return rows[torch.arange(len(flat)), flat % 8].view(*ids.shape, C)
        rows = self.blocks.index_select(0, flat)  # (N, row_bytes)
        return dequantize(rows, self.fmt, rows.shape[0], C).view(*ids.shape, C)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"


QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def _can_pack(m) -> bool:
    return not m.packed and m.fmt in PACKABLE and m.blocks.is_cpu and kernel_unavailable(m.fmt) is None


def pack_quantized(model: nn.Module) -> int:
    """Pack every quantized module's blocks (QuantizedLinear.pack), a tied head with its
    embedding (they keep sharing one buffer). Returns how many buffers were packed."""
    n = sum(m.pack() for m in model.modules() if isinstance(m, QuantizedEmbedding))
    if n and hasattr(model, "tie_weights"):
        model.tie_weights()  # the head re-reads the embedding's packed buffer
    shared = {id(m.blocks) for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    return n + sum(m.pack() for m in model.modules() if isinstance(m, QuantizedLinear) and id(m.blocks) not in shared)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by storage format ("q4_1", "q8_0", ..., or a dtype name such
    as "float32"), each tensor once however many modules share it (a tied output head)."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def add(kind: str, t: Tensor) -> None:
        if t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        out[kind] = out.get(kind, 0) + t.numel() * t.element_size()

    for m in model.modules():
        if isinstance(m, QUANTIZED):
            add(m.fmt, m.blocks)
    for p in model.parameters():
        add(str(p.dtype).removeprefix("torch."), p)
    return out
