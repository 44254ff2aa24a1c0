"""Combining partial attention results: the online-softmax merge, written once.

Attention over keys split into tiles is exact if each tile's result is kept with its
log-sum-exp: for two parts with outputs o_a, o_b (each normalized over its own keys)
and LSEs l_a, l_b, the whole is

    lse = logaddexp(l_a, l_b)
    out = o_a * exp(l_a - lse) + o_b * exp(l_b - lse)

(Milakov & Gimelshein 2018). Used by `chunked` (key tiles of one tensor) and `paged`
(tiles and views of a block pool).
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_lse(out: Tensor | None, lse: Tensor | None, o: Tensor, lse_o: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a part (o (..., R, Dv), lse_o (..., R) fp32) into the running (out, lse); out is fp32.

    out=None starts the running result with the part. Rows that no key of either side
    sees (LSE -inf on both) stay -inf with output 0, provided both outputs are 0 there.
    """
    if out is None:
        return o.float(), lse_o
    new = torch.logaddexp(lse, lse_o)
    ref = new.masked_fill(torch.isneginf(new), 0.0)
    out = out * (lse - ref).exp_()[..., None] + o.float() * (lse_o - ref).exp_()[..., None]
    return out, new
