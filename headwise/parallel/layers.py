"""Slices of a linear, and the two modules that put the slices' results back together.

Megatron-LM's split (Shoeybi et al. 2019, arXiv:1909.08053): a column-parallel linear keeps
some *output* rows of W (Q/K/V of this rank's heads, gate/up of its MLP columns) and needs
no communication; the row-parallel linear after it keeps the matching *input* columns
(out_proj over this rank's heads, down over its MLP columns), so each rank's product is a
partial sum of the whole output and one all-reduce completes it. The bias of a row-parallel
linear is added after the sum, once.

Each slice keeps its linear's kind: nn.Linear and PackedLinear stay so (fp32 slices, packed
again on first use); a QuantizedLinear keeps its GGML blocks (rows are independent, and an
input slice on block boundaries is a byte slice of every row), re-laid in the kernel's 8-row
groups where the original was; an input slice that cuts through blocks is dequantized to
fp32 (`take_columns` says so through `dequantized`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..models.linear import FORMATS, QuantizedLinear
from ..models.packing import PackedLinear, packing_available
from .comm import Comm


@torch.no_grad()
def take_rows(lin: nn.Module, rows: Tensor) -> nn.Module:
    """The linear restricted to output rows `rows` (a 1-D index tensor), of the same kind."""
    if isinstance(lin, QuantizedLinear):
        blocks = lin.file_blocks().index_select(0, rows.to(lin.blocks.device)).contiguous()
        bias = lin.bias is not None
        new = QuantizedLinear(lin.in_features, len(rows), lin.fmt, bias, blocks=blocks, device=blocks.device)
        if bias:
            new.bias.data = lin.bias.detach()[rows].clone()
        if lin.packed:
            new.pack()
        return new
    _check_dense(lin)
    rows = rows.to(lin.weight.device)
    b = lin.bias
    return _dense_like(type(lin), lin.weight.detach()[rows], None if b is None else b.detach()[rows])


@torch.no_grad()
def take_columns(lin: nn.Module, lo: int, hi: int) -> tuple[nn.Module, bool]:
    """(the linear over input features [lo, hi) without its bias, whether it was dequantized):
    the local part of a row-parallel linear; the caller adds the bias after the all-reduce."""
    if isinstance(lin, QuantizedLinear):
        _, block, nbytes = FORMATS[lin.fmt]
        if lo % block == 0 and hi % block == 0:
            O = lin.out_features
            per_row = lin.file_blocks().view(O, lin.in_features // block, nbytes)  # (O, blocks, bytes)
            blocks = per_row[:, lo // block : hi // block].reshape(O, -1).contiguous()
            new = QuantizedLinear(hi - lo, O, lin.fmt, blocks=blocks, device=blocks.device)
            if lin.packed:
                new.pack()
            return new, False
        w = lin.weight[:, lo:hi]  # (O, hi - lo) fp32: the slice cuts through blocks
        return _dense_like(nn.Linear if packing_available() else PackedLinear, w, None), True
    _check_dense(lin)
    return _dense_like(type(lin), lin.weight.detach()[:, lo:hi], None), False


def _check_dense(lin: nn.Module) -> None:
    if not isinstance(lin, nn.Linear):
        raise TypeError(
            f"cannot slice a {type(lin).__name__} for tensor parallelism; "
            "supported: nn.Linear, PackedLinear and QuantizedLinear"
        )


def _dense_like(cls: type[nn.Linear], weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A `cls` (nn.Linear or PackedLinear: nn.Linear's constructor and parameters) over copies,
    built on meta so that nothing is allocated before the copies are assigned."""
    new = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return new


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: x_r (..., in_r) this rank's slice of the input features,
    W_r (out, in_r) the matching columns of W (`local`), b (out,) the full bias, added once.

    A block's few-rows route sees an unknown module here and calls it, then adds the residual:
    the residual is added after the sum, as it must be (the one-kernel decode layer of
    models/layer_step.py, which adds it inside out_proj, is not taken for these layers)."""

    def __init__(self, local: nn.Module, bias: Tensor | None, comm: Comm, what: str):
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.comm, self.what = comm, what
        self.in_features = local.in_features  # this rank's share
        self.out_features = local.out_features

    @property
    def weight(self) -> Tensor:
        """(out, in_r): this rank's columns of the weight (a dequantized copy when quantized)."""
        return self.local.weight

    def forward(self, x: Tensor) -> Tensor:
        y = self.local(x).contiguous()  # (..., out): this rank's partial sum
        self.comm.all_reduce(y, self.what)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return f"{self.what}: in_features={self.in_features} of {self.comm.world_size} ranks, all-reduce"


class VocabParallelHead(nn.Module):
    """The output head split over the vocabulary: each rank computes logits for its rows of
    W (`local`, (V_r, C)) and one all-gather puts the (..., V) logits together on every rank.
    Each rank reads 1/N of the head's weights a step; the price is one all-gather of V floats
    a row (benchmarks/parallel.py measures which is faster here)."""

    def __init__(self, local: nn.Module, sizes: list[int], comm: Comm):
        super().__init__()
        self.local, self.sizes, self.comm = local, sizes, comm
        self.in_features, self.out_features = local.in_features, sum(sizes)

    @property
    def weight(self) -> Tensor:
        return self.local.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.all_gather_last(self.local(x), self.sizes, "the output head")  # (..., V)

    def extra_repr(self) -> str:
        return f"vocab {self.sizes[self.comm.rank]} of {self.out_features} rows, all-gather"
