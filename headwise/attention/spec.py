"""What one attention call asks for, validated once and shared by every backend.

`attend()` turns its keyword arguments into an `AttentionSpec`; each backend is a
plain function `backend(q, k, v, spec) -> AttentionOutput`. Shapes follow the
seed's KV-cache layout:

    q: (B, H, T, D)      k: (B, Hkv, S, D)      v: (B, Hkv, S, Dv)

with H % Hkv == 0 (MHA when equal, GQA when 1 < Hkv < H, MQA when Hkv == 1).
Query row i sits at absolute position S - T + i ("bottom-right" alignment), so a
causal call with T new tokens against S cached keys is right for decoding and
chunked prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class AttentionOutput(NamedTuple):
    out: Tensor  # (B, H, T, Dv)
    lse: Tensor | None = None  # (B, H, T) fp32 log-sum-exp of the scaled, masked scores; -inf on fully masked rows
    weights: Tensor | None = None  # (B, H, T, S) softmax weights (math backend only)


@dataclass(frozen=True)
class AttentionSpec:
    B: int
    H: int
    Hkv: int
    T: int
    S: int
    D: int
    scale: float
    attn_mask: Tensor | None = None  # (B|1, H|1, T, S): bool (True = may attend) or float (added)
    key_padding_mask: Tensor | None = None  # (B, S) bool, True = padded key (ignored)
    is_causal: bool = False
    window: tuple[int, int] | None = None  # (left, right): keys in [p - left, p + right] are visible
    alibi_slopes: Tensor | None = None  # (B|1, H) fp32
    dropout_p: float = 0.0
    need_weights: bool = False
    return_lse: bool = False
    kv_map: Tensor | None = None  # (H,) KV head of each query head (uneven groups); paged reads only
    # Logit soft-capping (Gemma 2's attn_logit_softcapping): scaled scores s become c * tanh(s / c)
    # before masks and biases are applied, as Hugging Face's eager attention does. None = off.
    softcap: float | None = None

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return self.H // self.Hkv

    @property
    def q_offset(self) -> int:
        """Absolute position of query row 0 (bottom-right alignment)."""
        return self.S - self.T

    @property
    def has_mask(self) -> bool:
        return (
            self.attn_mask is not None or self.key_padding_mask is not None or self.is_causal or self.window is not None
        )


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def make_spec(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask=None,
    key_padding_mask=None,
    is_causal=False,
    window=None,
    alibi_slopes=None,
    scale=None,
    dropout_p=0.0,
    need_weights=False,
    return_lse=False,
    softcap=None,
) -> AttentionSpec:
    """Check shapes and options once; every error names the shapes involved."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, T, D)" if name == "q" else "(B, Hkv, S, D)"
            raise ValueError(f"{name} must have 4 dims {want}, got shape {_shape(t)}")
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {_shape(k)} and v {_shape(v)} must agree on (B, Hkv, S)")
    if Bk != B:
        raise ValueError(f"q has batch {B} but k/v have batch {Bk}")
    if Dk != D:
        raise ValueError(f"q has head dim {D} but k has head dim {Dk}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"num_heads={H} (q) is not divisible by num_kv_heads={Hkv} (k/v)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, B, H, T, S, q)
    if key_padding_mask is not None:
        if _shape(key_padding_mask) != (B, S):
            raise ValueError(
                f"key_padding_mask has shape {_shape(key_padding_mask)} but must be "
                f"(B, S) = ({B}, {S}): batch {B}, keys of length {S}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padded key), got {key_padding_mask.dtype}")
    if window is not None:
        window = _check_window(window, is_causal)
        if window_covers_all(window, is_causal, T, S):
            window = None  # a window as long as the keys masks nothing: the kernels' fast paths take it
    if alibi_slopes is not None:
        if alibi_slopes.dim() == 1:
            alibi_slopes = alibi_slopes.unsqueeze(0)
        if alibi_slopes.dim() != 2 or alibi_slopes.shape[0] not in (1, B) or alibi_slopes.shape[1] != H:
            raise ValueError(f"alibi_slopes must be (H,) or (B, H) = ({B}, {H}), got {_shape(alibi_slopes)}")
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
    return AttentionSpec(
        B,
        H,
        Hkv,
        T,
        S,
        D,
        float(scale),
        attn_mask,
        key_padding_mask,
        bool(is_causal),
        window,
        alibi_slopes,
        float(dropout_p),
        bool(need_weights),
        bool(return_lse),
        None,
        check_softcap(softcap),
    )


def check_softcap(softcap) -> float | None:
    """None, or the cap c > 0 of c * tanh(s / c) as a float."""
    if softcap is None:
        return None
    c = float(softcap)
    if not c > 0 or math.isinf(c):
        raise ValueError(f"softcap must be a finite number > 0 (scores become c * tanh(s / c)), got {softcap}")
    return c


def soft_cap(scores: Tensor, softcap: float | None) -> Tensor:
    """c * tanh(s / c) (Gemma 2), or the scores unchanged; before masks and biases."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _check_attn_mask(mask: Tensor, B: int, H: int, T: int, S: int, q: Tensor) -> Tensor:
    """Accept any mask that broadcasts to (B, H, T, S) dim by dim (each dim 1 or exact)."""
    if mask.dim() < 2 or mask.dim() > 4:
        raise ValueError(
            f"attn_mask must have 2 to 4 dims broadcastable to (B, H, T, S) = "
            f"({B}, {H}, {T}, {S}), got shape {_shape(mask)}"
        )
    m4 = mask.reshape((1,) * (4 - mask.dim()) + _shape(mask))
    for got, want, dim in zip(m4.shape, (B, H, T, S), "BHTS"):
        if got not in (1, want):
            raise ValueError(
                f"attn_mask has shape {_shape(mask)}, which does not broadcast to "
                f"(B, H, T, S) = ({B}, {H}, {T}, {S}): dim {dim} is {got}, expected 1 or {want}"
            )
    if m4.shape[2] != T or m4.shape[3] != S:
        # Broadcasting over queries/keys is legal but almost always a bug; be strict.
        raise ValueError(f"attn_mask has shape {_shape(mask)} but queries x keys is {T} x {S}")
    if m4.dtype != torch.bool and not m4.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or float (added to scores), got {m4.dtype}")
    return m4.to(q.device)


def window_covers_all(window: tuple[int, int], is_causal: bool, T: int, S: int) -> bool:
    """Whether (left, right) hides no key from any query (positions S - T .. S - 1 against keys
    0 .. S - 1): a Gemma 3 local layer's 512 while the context is shorter."""
    left, right = window
    return left >= S - 1 and (is_causal or right >= T - 1)


def _check_window(window, is_causal: bool) -> tuple[int, int]:
    if isinstance(window, bool) or not isinstance(window, (int, tuple, list)):
        raise TypeError(f"window must be an int W or a (left, right) pair, got {window!r}")
    if isinstance(window, int):
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys visible per query), got {window}")
        # A window of W keys ending at the query itself; symmetric when not causal.
        return (window - 1, 0 if is_causal else window - 1)
    left, right = window
    if left < 0 or right < 0:
        raise ValueError(f"window (left, right) must be >= 0, got {window}")
    return (int(left), int(right))
