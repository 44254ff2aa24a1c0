"""Rotary position embeddings (Su et al. 2021, "RoFormer").

Pairs of channels are rotated by an angle proportional to the token's absolute
position, so q_m . k_n depends only on m - n. Two layouts exist in the wild:
- halves (Llama in HF transformers, GPT-NeoX): channel i pairs with i + D/2;
- interleaved (Meta's original Llama, GPT-J): channel 2i pairs with 2i + 1.
Scaling variants (linear, NTK, llama3) change only `inv_freq`; the models issue
adds them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, inv_freq: Tensor | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim must be even, got {dim}")
        self.dim, self.base, self.interleaved = dim, base, interleaved
        if inv_freq is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (dim/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # table()'s (inv_freq, its version, P, cos, sin): remade when inv_freq is replaced or
        # edited in place, or a longer table is asked for
        self._table: tuple[Tensor, int | None, int, Tensor, Tensor] | None = None

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles, each (B|1, 1, T, dim/2) fp32, for positions (T,) or (B, T).

        A model computes these once per forward and hands them to every layer
        (`MultiHeadAttention(..., rope_cos_sin=)`), instead of each layer computing
        them twice (for q and for k). Subclasses that scale with the sequence
        (dynamic NTK) override this.
        """
        if positions.dim() == 1:
            positions = positions[None]  # (1, T)
        angles = positions[:, None, :, None].float() * self.inv_freq  # (B|1, 1, T, dim/2)
        return angles.cos(), angles.sin()

    def table(self, n: int) -> tuple[Tensor, Tensor]:
        """cos and sin (P, dim/2) contiguous fp32 of positions 0 .. P - 1, P >= n: cos_sin's own
        numbers, kept and doubled as positions grow, remade when inv_freq is replaced or edited.
        Decode steps take their rows from it (Step.rope_rows) instead of eight ops each."""
        inv = self._buffers["inv_freq"]
        version = None if inv.is_inference() else inv._version
        t = self._table
        if t is None or t[0] is not inv or t[1] != version or t[2] < n:
            P = max(n, 256 if t is None else 2 * t[2] if t[2] < n else t[2])
            with torch.inference_mode(False), torch.no_grad():  # plain tensors: usable in any mode
                cos, sin = self.cos_sin(torch.arange(P, device=inv.device))
            t = self._table = (inv, version, P, cos.view(P, -1), sin.view(P, -1))
        return t[3], t[4]

    def forward(
        self, x: Tensor, positions: Tensor | None = None, *, cos_sin: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Rotate the first `dim` channels of x (B, H, T, D) at positions (T,) or (B, T),
        or by a precomputed `cos_sin` (from `self.cos_sin(positions)`)."""
        T = x.shape[-2]
        if cos_sin is None:
            if positions is None:
                raise ValueError("pass positions (T,) or (B, T), or cos_sin from RotaryEmbedding.cos_sin")
            if positions.shape[-1] != T:
                raise ValueError(f"positions has length {positions.shape[-1]} but x has {T} tokens")
            cos_sin = self.cos_sin(positions)
        cos, sin = cos_sin
        if cos.shape[-2] != T:
            raise ValueError(f"cos_sin covers {cos.shape[-2]} positions but x has {T} tokens")
        rot, rest = x[..., : self.dim].float(), x[..., self.dim :]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rot.to(x.dtype), rest), dim=-1) if rest.shape[-1] else rot.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"
