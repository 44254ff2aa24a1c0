"""int8 K/V with one scale per (token, head): what it stores, what it costs.

Symmetric absmax quantization per (token, head) row of D channels (the layout of
KIVI's per-token value scheme and of vLLM's int8 caches): scale = amax(|x|)/127,
q = round(x / scale). Each row is scaled by its own maximum, so the rounding error
of an element is at most scale/2 = amax/254, i.e. <= 0.4% of that row's largest
entry; an attention output, a weighted mean of V rows with weights computed from
quantized K, inherits an error of the same order (tests/cache/test_quantized.py
bounds it at 2e-2 of the output's max, measured ~4e-3).

Scales are stored in **fp32**, not fp16: they are 1/D of the payload (4 bytes per
(token, head) next to D int8 bytes, 6% at D=64 where fp16 would be 3%), and fp32
keeps them exact over the whole range, where fp16 scales go subnormal for rows
with amax < 7.8e-3 (small-magnitude value heads exist) and lose digits. Bytes per
element are then 1 + 4/D: 0.27x fp32 at D=64, 0.26x at D=128 (the issue asks for
<= 0.3x; that holds for every D >= 20).

The caches store int8 and dequantize on read: every read of S tokens costs one
pass over S*Hkv*D int8 values (written out in the compute dtype) before attention
runs. That is the same order as attention itself, so on that route int8 saves
memory, not time. A decode step that takes the one-call stack (kernels/decoder_step.c,
models/layer_step.py: one new token per sequence, contiguous or paged) does not
dequantize: the kernel quantizes the new keys and values exactly as quantize_int8
does and its attention reads the int8 rows, widening each tile of 8 keys in cache,
so a long context's decode streams ~1/4 of fp32's K/V bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .protocol import CacheRead

SCALE_DTYPE = torch.float32  # see the module docstring for why not fp16
SCALE_BYTES = 4
INT8_KV_DTYPES = ("int8", torch.int8)
# 16-bit K/V: stored by rounding the compute dtype's values to nearest even (torch's .to()), read
# back exactly (.float()); the C decode kernels widen them in registers (kernels/attention.py)
KV16_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., D) -> (q (..., D) int8, scale (..., 1) fp32) with x ~= q * scale.

    scale = amax(|x|, dim=-1) / 127 per row; an all-zero row gets scale 0 (and
    dequantizes to zeros).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # (..., 1)
    q = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny))  # |q| <= 127 by construction
    return q.clamp_(-127, 127).to(torch.int8), scale.to(SCALE_DTYPE)


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(q (..., D) int8, scale (..., 1)) -> q * scale in `dtype` (computed in fp32, rounded once)."""
    # Convert, then scale in place: 2x faster on CPU than the type-promoting `q * scale` (measured,
    # (1, 12, 8192, 64)), whose mixed-dtype loop is not vectorized.
    x = q.to(torch.float32).mul_(scale)
    return x if dtype == torch.float32 else x.to(dtype)


def kv_kind(kv_dtype) -> str | None:
    """Validate a cache's `kv_dtype` and name it: None (store the compute dtype), "int8", "bfloat16" or
    "float16" (also as torch dtypes, or "bf16", "fp16", "half")."""
    if kv_dtype is None:
        return None
    if kv_dtype in INT8_KV_DTYPES:
        return "int8"
    name = str(kv_dtype).removeprefix("torch.").lower() if isinstance(kv_dtype, (str, torch.dtype)) else None
    name = KV_DTYPE_ALIASES.get(name, name)
    if name in KV16_DTYPES:
        return name
    raise ValueError(
        f"kv_dtype must be None (store K/V in the compute dtype), 'bfloat16', 'float16' or 'int8', got {kv_dtype!r}"
    )


def is_int8(kv_dtype) -> bool:
    """Validate a cache's `kv_dtype` (`kv_kind`); whether it stores int8."""
    return kv_kind(kv_dtype) == "int8"


def storage_dtype(kv_kind: str | None, dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of `kv_kind` (kv_kind's name) stores values in, computing in `dtype`."""
    return torch.int8 if kv_kind == "int8" else KV16_DTYPES.get(kv_kind, dtype)


@dataclass(frozen=True)
class Int8CacheRead:
    """What an int8 cache hands attention: int8 K/V plus scales, dequantized when attended.

    Shapes as `CacheRead`: k_q (B, Hkv, S, D) int8, k_scale (B, Hkv, S, 1) fp32.
    Dequantization is deferred to `attend` so that a cache update alone never pays
    the O(S) read.
    """

    k_q: Tensor
    k_scale: Tensor
    v_q: Tensor
    v_scale: Tensor
    dtype: torch.dtype  # the compute dtype K/V come back in
    key_padding_mask: Tensor | None = None  # (B, S) bool, True = slot holds no real key
    attn_mask: Tensor | None = None  # (B, 1, T, S) bool, True = may attend (encodes causality)

    def dequantize(self) -> CacheRead:
        return CacheRead(
            dequantize_int8(self.k_q, self.k_scale, self.dtype),
            dequantize_int8(self.v_q, self.v_scale, self.dtype),
            self.key_padding_mask,
            self.attn_mask,
        )

    @property
    def k(self) -> Tensor:
        return dequantize_int8(self.k_q, self.k_scale, self.dtype)

    @property
    def v(self) -> Tensor:
        return dequantize_int8(self.v_q, self.v_scale, self.dtype)

    def attend(self, q: Tensor, **kwargs):
        return self.dequantize().attend(q, **kwargs)


def kv_bytes_per_token(config, dtype: str | torch.dtype = "bf16") -> int:
    """Bytes of K and V that one token takes in every layer of `config` (a ModelConfig).

    Float dtypes: exactly `headwise.core.plan.kv_bytes_per_token`, 2 * L * Hkv * D * bytes.
    "int8": the planner's 1 byte per element plus one fp32 scale per (token, head) for
    K and for V, 2 * L * Hkv * (D + 4), which is what the int8 caches allocate.
    `dtype` may be a name ("bf16", "fp32", "int8") or a torch.dtype.
    """
    from ..core.plan import kv_bytes_per_token as planned

    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    payload = planned(config, name)
    if name.strip().lower() == "int8":
        return payload + 2 * config.num_layers * config.num_kv_heads * SCALE_BYTES
    return payload
