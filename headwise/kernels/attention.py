"""Decode attention over strided K/V views (decode_attention.c), for the paged backend's "regions" read.

`decode_attention(q, k, v, lengths, scale, want_lse)`: the G query rows of each (sequence,
KV head) pair over that sequence's first lengths[c] keys, one pass over K and V with an online
softmax, no mask tensor. k and v may be as_strided views of a block pool (cache/packed.py
region_views); only each key's D floats need be contiguous.

The paged backend's "regions" read (attention/backends/paged.py `_attend_regions`) calls it in
place of PyTorch's flash kernel with an additive length mask; the C source and its build are
described in decode_attention.c and kernels/__init__.py.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import _ext, kernels_unavailable

MAX_G, MAX_D = 16, 256  # decode_attention.c's MAX_G, MAX_D: its per-pair stack buffers
# What K/V elements the kernels read (kernels.h's KV_*): fp32, or 16-bit widened in registers a
# tile at a time; int8 (with scales) only through the decoder stack (kernels/layer.py)
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2, torch.float16: 3}
KV_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # decode_attention's K/V dtypes


def fits(G: int, D: int) -> bool:
    """Whether the kernel takes G query rows per KV head of head_dim D (else use another path)."""
    return 1 <= G <= MAX_G and 8 <= D <= MAX_D and D % 8 == 0


@functools.cache
def decode_attention_unavailable() -> str | None:
    """None when decode_attention runs here, else why it does not."""
    why = kernels_unavailable()
    if why is not None:
        return why
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 1, 3, 8), (2, 1, 11, 8), (2, 1, 11, 8)))
    lengths = torch.tensor([11, 5])
    out, lse = _call(q, k, v, lengths, 0.5, True)
    s = (q @ k.transpose(-1, -2)) * 0.5  # (2, 1, 3, 11)
    s[1, :, :, 5:] = float("-inf")
    want = torch.softmax(s, -1) @ v
    if not (torch.allclose(out, want, atol=1e-4) and torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-4)):
        return "the compiled decode-attention kernel disagrees with softmax(q k^T) v"
    return None


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, want_lse: bool = False, softcap: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale) v of each sequence c over its keys [0, lengths[c]), fp32 on CPU;
    softcap c > 0: scores c * tanh(s / c) (Gemma 2), LSE of those.

    q (C, Hkv, G, D) fp32 contiguous; k, v (C, Hkv, width, D), fp32, bf16 or fp16 (both the same:
    16-bit keys are widened to fp32 in registers, exactly), any strides but the last (1);
    lengths (C,) int64 in [0, width]. -> (out (C, Hkv, G, D), lse (C, Hkv, G) natural-log LSE
    of the scaled scores, or None). A sequence with no keys gets out 0 and lse -inf.
    No autograd. Check `decode_attention_unavailable()` first.

    Against `_scaled_dot_product_flash_attention_for_cpu` with the length mask (AMD EPYC Zen 3,
    AVX2, 2 threads, SmolLM2's Hkv=3, G=3, D=64, lengths width - 20, wrapper overhead included;
    the machine shared with another busy process, so absolute times vary by ~30%):
    "hot" = one pool read again and again (in L3), "cold" = 30 pools in turn (30 layers' worth):

        B   width   hot: flash   kernel           cold: flash   kernel
        16  256          985 us  417 us (2.4x)          1372 us  674 us (2.0x)
        16  512         2388 us  725 us (3.3x)          2758 us 1234 us (2.2x)
        64  256         5654 us 2139 us (2.6x)          5524 us 2403 us (2.3x)
        64  512         8371 us 3964 us (2.1x)          8652 us 3829 us (2.3x)

    The engine's 16-decode step (SmolLM2-135M, 30 layers), alternating the two: min 81 vs 91 ms.
    """
    why = decode_attention_unavailable()
    if why is not None:
        raise RuntimeError(f"decode_attention is unavailable: {why}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"decode_attention: softcap must be a finite number > 0 or None, got {softcap!r}")
    _check(q, k, v, lengths)
    return _run(q, k, v, lengths, scale, want_lse, softcap=softcap)


def paged_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tensor,
    block_size: int,
    lengths: Tensor,
    scale: float,
    want_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """decode_attention over a paged pool through block tables, in place: sequence c's key t is
    row tables[c, t // block_size] * block_size + t % block_size of k's and v's head planes (the
    addressing kernels.layer.run_stack uses for a packed step over a fragmented pool).

    q (C, Hkv, G, D) contiguous; k, v (Hkv, rows, D), each key's D floats contiguous (a layer's
    (Hkv, num_blocks, block_size, D) pool viewed as (Hkv, num_blocks * block_size, D)); tables
    (C, width) int64, every entry a block of the pool; lengths (C,) int64 in [0, width *
    block_size]. -> (out (C, Hkv, G, D), lse (C, Hkv, G) or None), as decode_attention."""
    why = decode_attention_unavailable()
    if why is not None:
        raise RuntimeError(f"decode_attention is unavailable: {why}")
    C = q.shape[0] if q.dim() == 4 else -1
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"paged_decode_attention: block_size must be a positive int, got {block_size!r}")
    if k.dim() != 3 or v.shape != k.shape or q.dim() != 4 or k.shape[0] != q.shape[1] or k.shape[2] != q.shape[3]:
        raise ValueError(
            f"paged_decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (Hkv, rows, D) for q "
            f"{tuple(q.shape)} (C, Hkv, G, D)"
        )
    if tables.dtype is not torch.int64 or tables.dim() != 2 or tables.shape[0] != C or not tables.is_contiguous():
        raise ValueError(
            f"paged_decode_attention: tables must be a contiguous int64 (C, width) = ({C}, width) tensor; got "
            f"{tables.dtype} {tuple(tables.shape)}"
        )
    blocks = k.shape[1] // block_size
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
        raise ValueError(f"paged_decode_attention: tables name blocks outside the pool's {blocks} blocks")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (KV_FLOATS if name != "q" else (torch.float32,)) or not t.is_cpu or t.stride(-1) != 1:
            raise ValueError(
                f"paged_decode_attention: {name} must be {'fp32' if name == 'q' else 'fp32, bf16 or fp16'} on the "
                f"CPU with each key's D elements contiguous; got {t.dtype} {tuple(t.shape)} strides {t.stride()} on "
                f"{t.device}"
            )
    if k.dtype != v.dtype:
        raise ValueError(f"paged_decode_attention: k ({k.dtype}) and v ({v.dtype}) must share a dtype")
    if not q.is_contiguous() or not fits(q.shape[2], q.shape[3]):
        raise ValueError(
            f"paged_decode_attention: q {tuple(q.shape)} must be contiguous with 1 <= G <= {MAX_G}, "
            f"8 <= D <= {MAX_D}, D % 8 == 0"
        )
    if lengths.dtype is not torch.int64 or lengths.shape != (C,) or not lengths.is_contiguous():
        raise ValueError(f"paged_decode_attention: lengths must be a contiguous int64 ({C},) tensor")
    if C and (int(lengths.min()) < 0 or int(lengths.max()) > tables.shape[1] * block_size):
        raise ValueError(
            f"paged_decode_attention: lengths must lie in [0, width * block_size = {tables.shape[1] * block_size}]"
        )
    return paged_decode_attention_unchecked(q, k, v, tables, block_size, lengths, scale, want_lse)


def paged_decode_attention_unchecked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tensor,
    block_size: int,
    lengths: Tensor,
    scale: float,
    want_lse: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """paged_decode_attention for a caller that built the tables from the pool itself (the paged
    backend, every layer of a step): no checks, none of their tensor reductions per layer."""
    return _run(q, k, v, lengths, scale, want_lse, (0, k.stride(0), k.stride(1)), tables, block_size, softcap)


def _call(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, want_lse: bool):
    _check(q, k, v, lengths)
    return _run(q, k, v, lengths, scale, want_lse)


def decode_attention_all_keys(
    q: Tensor, k: Tensor, v: Tensor, scale: float, want_lse: bool = False, softcap: float | None = None
):
    """decode_attention where every query sees all of k's keys (a decode step over a contiguous
    cache, or the view of a window's keys), for a caller that has checked the shapes, dtypes and
    strides already (the `decode` attention backend, whose check runs once per kind of request):
    no lengths tensor, no checks, the least Python between the kernels of a decode step."""
    return _run(q, k, v, None, scale, want_lse, softcap=softcap)


def _run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor | None,
    scale: float,
    want_lse: bool,
    strides: tuple[int, int, int] | None = None,
    tables: Tensor | None = None,
    block_size: int = 0,
    softcap: float | None = None,
):
    """The kernel call. strides: K's and V's (sequence, head, key) strides in elements (default:
    those of 4-D views (C, Hkv, width, D)); tables (C, width) int64: keys through block tables;
    softcap: None, or c > 0 for scores c * tanh(s / c) (the kernel's 0 = none)."""
    C, Hkv, G, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(C, Hkv, G) if want_lse else None
    rc = _ext()[0].decode_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        C,
        Hkv,
        G,
        D,
        *(strides or k.stride()[:3]),
        *(strides or v.stride()[:3]),  # K and V of one pool share their layout
        None if lengths is None else lengths.data_ptr(),
        float(scale),
        0 if tables is not None else k.shape[2],
        None if tables is None else tables.data_ptr(),
        0 if tables is None else tables.shape[1],
        block_size,
        0.0 if softcap is None else float(softcap),
        KV_KINDS[k.dtype],
    )
    if rc:  # the checks rule these out; a mismatch means the C and Python limits drifted apart
        raise RuntimeError(f"decode_attention kernel refused G={G}, D={D}, block_size={block_size} (code {rc})")
    return out, lse


def _check(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (KV_FLOATS if name != "q" else (torch.float32,)) or not t.is_cpu or t.dim() != 4:
            raise ValueError(
                f"decode_attention: {name} must be a 4-D {'fp32' if name == 'q' else 'fp32, bf16 or fp16'} CPU "
                f"tensor; got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if k.dtype != v.dtype:
        raise ValueError(f"decode_attention: k ({k.dtype}) and v ({v.dtype}) must share a dtype")
    if not q.is_contiguous():
        raise ValueError(f"decode_attention: q {tuple(q.shape)} must be contiguous (call .contiguous())")
    C, Hkv, G, D = q.shape
    if not fits(G, D):
        raise ValueError(
            f"decode_attention: G={G} query rows per KV head and head_dim D={D} need 1 <= G <= {MAX_G}, "
            f"8 <= D <= {MAX_D} and D % 8 == 0; use PyTorch's attention for this shape"
        )
    if k.shape != v.shape or k.shape[:2] != (C, Hkv) or k.shape[3] != D:
        raise ValueError(
            f"decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (C, Hkv, width, D) = "
            f"({C}, {Hkv}, width, {D}) for q {tuple(q.shape)}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"decode_attention: each key's D floats must be contiguous (stride(-1) == 1); "
            f"got k strides {k.stride()}, v strides {v.stride()}"
        )
    width = k.shape[2]
    if lengths.dtype is not torch.int64 or not lengths.is_cpu or lengths.shape != (C,) or not lengths.is_contiguous():
        raise ValueError(
            f"decode_attention: lengths must be a contiguous int64 CPU tensor of shape ({C},); "
            f"got {lengths.dtype} {tuple(lengths.shape)} on {lengths.device}"
        )
    lo, hi = (int(x) for x in torch.aminmax(lengths)) if C else (0, 0)
    if lo < 0 or hi > width:
        raise ValueError(f"decode_attention: lengths must lie in [0, width={width}]; got min {lo}, max {hi}")
