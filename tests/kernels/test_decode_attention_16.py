"""The C decode-attention kernel reading bf16 / fp16 K/V as stored (csrc/x86/avx2/decode_pair.h widens
each tile in registers) against softmax(q k^T) v in float64 on the same rounded K/V: the 16-bit read
adds no error of its own, so fp32 tolerances hold."""

import pytest
import torch

from headwise.kernels import attention as ka

pytestmark = pytest.mark.skipif(ka.decode_attention_unavailable() is not None, reason="no kernels")

DTYPES = [torch.bfloat16, torch.float16]


def reference(q, k, v, lengths, scale, softcap=None):
    """float64 softmax over each sequence's first lengths[c] keys -> (out, lse)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (C, Hkv, G, width)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(torch.arange(k.shape[2]) >= lengths[:, None, None, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.double(), torch.logsumexp(s, -1)


# G=1 (one query row a KV head: MHA) takes the avx512 variant's other path, widening as it reads
@pytest.mark.parametrize("G", [3, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,softcap", [(64, None), (72, None), (64, 30.0)])  # 72: the ymm tail after zmm
def test_16bit_kv_equals_float64_on_the_rounded_values(dtype, D, softcap, G):
    g = torch.Generator().manual_seed(D)
    q = torch.randn(3, 3, G, D, generator=g)
    k = (torch.randn(3, 3, 41, D, generator=g) * 2).to(dtype)
    v = torch.randn(3, 3, 41, D, generator=g).to(dtype)
    lengths = torch.tensor([41, 13, 0])
    out, lse = ka.decode_attention(q, k, v, lengths, 0.2, want_lse=True, softcap=softcap)
    want, want_lse = reference(q, k, v, lengths, 0.2, softcap)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse[:2].double(), want_lse[:2], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("G", [4, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_16bit_paged_read_through_block_tables(dtype, G):
    """A pool of 16-bit blocks read in place through tables (the packed step's "decodes" part)."""
    g = torch.Generator().manual_seed(1)
    Hkv, D, bs, blocks = 2, 64, 4, 12
    pool_k = torch.randn(Hkv, blocks * bs, D, generator=g).to(dtype)
    pool_v = torch.randn(Hkv, blocks * bs, D, generator=g).to(dtype)
    tables = torch.tensor([[7, 2, 9, 0], [11, 3, 0, 0]])
    lengths = torch.tensor([14, 5])
    q = torch.randn(2, Hkv, G, D, generator=g)
    out, _ = ka.paged_decode_attention(q, pool_k, pool_v, tables, bs, lengths, 0.125)
    rows = (tables[:, :, None] * bs + torch.arange(bs)).reshape(2, -1)  # (C, width) slot of each key
    k, v = pool_k[:, rows].transpose(0, 1), pool_v[:, rows].transpose(0, 1)  # (C, Hkv, width, D)
    want, _ = reference(q, k, v, lengths, 0.125)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)


def test_mixed_or_int8_kv_refused():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="must share a dtype"):
        ka.decode_attention(q, k.bfloat16(), k.half(), torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        ka.decode_attention(q, k.to(torch.int8), k.to(torch.int8), torch.tensor([4]), 1.0)
