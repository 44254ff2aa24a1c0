"""The C decode layer stack (kernels/layer.py, csrc/generic/decoder_step.c) with each part of a
family's block spec -- QK-norm, post-norms, GeGLU, a sliding window, a scale of its own, a ring of
keys, a paged table whose window starts inside a block -- against a torch layer written here from
the papers' formulas (not headwise's modules), and the GeGLU prologue against torch's GELU."""

import pytest
import torch
import torch.nn.functional as F

from headwise import kernels
from headwise.kernels import layer as kernel_layer

pytestmark = pytest.mark.skipif(kernels.kernels_unavailable() is not None, reason="no kernels")

C, H, Hkv, D, FF = 64, 4, 2, 16, 96
EPS = 1e-6


@pytest.mark.parametrize("M,I", [(1, 96), (7, 13), (9, 2048), (513, 64)])
def test_geglu_equals_torch(M, I):
    gu = torch.randn(M, 2 * I, generator=torch.Generator().manual_seed(M + I)) * 4
    gate, up = gu.chunk(2, dim=-1)
    want = F.gelu(gate.double(), approximate="tanh") * up.double()
    got = kernels.swiglu(gu, kernels.PRO_GEGLU)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):  # x (..., D), half-split (rotate_half) over the first 2 * len(cos) channels
    h = cos.shape[-1]
    a, b, rest = x[..., :h], x[..., h : 2 * h], x[..., 2 * h :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _layer(spec):
    """The layer's weights and norms (fp32), random but of sane scale."""
    g = torch.Generator().manual_seed(3)

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    out = {
        "qkv": r((H + 2 * Hkv) * D, C, s=C**-0.5),
        "out": r(C, H * D, s=(H * D) ** -0.5),
        "gate_up": r(2 * FF, C, s=C**-0.5),
        "down": r(C, FF, s=FF**-0.5),
        "attn_norm": 1 + 0.1 * r(C),
        "mlp_norm": 1 + 0.1 * r(C),
    }
    if spec.get("qk"):
        out["q_norm"], out["k_norm"] = 1 + 0.3 * r(D), 1 + 0.3 * r(D)
    if spec.get("post"):
        out["post_attn"], out["post_mlp"] = 1 + 0.3 * r(C), 1 + 0.3 * r(C)
    return out


def _reference(w, spec, x, K, V, slots_of, pos, cos, sin):
    """One decode step of M rows in float64: row m writes its key at slots_of(m, pos[m]) of K, V
    (Hkv, rows, D) views per row and attends over the keys of its window (positions)."""
    d = {k: t.double() for k, t in w.items()}
    x = x.double()
    h = _rms(x, d["attn_norm"], EPS) @ d["qkv"].T
    q = h[:, : H * D].view(-1, H, D)
    k = h[:, H * D : (H + Hkv) * D].view(-1, Hkv, D)
    v = h[:, (H + Hkv) * D :].view(-1, Hkv, D)
    if spec.get("qk"):
        q, k = _rms(q, d["q_norm"], 1e-5), _rms(k, d["k_norm"], 1e-5)
    ys = []
    for m in range(x.shape[0]):
        c, s = cos[m].double(), sin[m].double()
        qm, km = _rope(q[m], c, s), _rope(k[m], c, s)
        Km, Vm = K(m), V(m)
        Km[:, slots_of(m, pos[m])] = km.float()
        Vm[:, slots_of(m, pos[m])] = v[m].float()
        W = spec.get("window") or pos[m] + 1
        keys = range(max(0, pos[m] + 1 - W), pos[m] + 1)
        idx = [slots_of(m, p) for p in keys]
        kk, vv = Km[:, idx].double(), Vm[:, idx].double()  # (Hkv, n, D)
        scale = spec.get("scale") or D**-0.5
        G = H // Hkv
        scores = torch.einsum("hd,hnd->hn", qm, kk.repeat_interleave(G, 0)) * scale
        if spec.get("softcap"):  # Gemma 2: c tanh(s / c)
            scores = spec["softcap"] * torch.tanh(scores / spec["softcap"])
        att = torch.softmax(scores, -1)
        ys.append(torch.einsum("hn,hnd->hd", att, vv.repeat_interleave(G, 0)).reshape(H * D))
    o = torch.stack(ys)
    t = o @ d["out"].T
    h1 = x + (_rms(t, d["post_attn"], EPS) if spec.get("post") else t)
    gate, up = (_rms(h1, d["mlp_norm"], EPS) @ d["gate_up"].T).chunk(2, -1)
    act = F.gelu(gate, approximate="tanh") if spec.get("glu") == "gelu_tanh" else F.silu(gate)
    t2 = (act * up) @ d["down"].T
    return h1 + (_rms(t2, d["post_mlp"], EPS) if spec.get("post") else t2)


def _plan(w, spec):
    plans = [kernels.plan_linear(kernels.block_weight(w[n]), w[n].shape[0]) for n in ("qkv", "out", "gate_up", "down")]
    return kernel_layer.plan_step(
        tuple(plans),
        w["attn_norm"],
        w["mlp_norm"],
        EPS,
        H,
        Hkv,
        D,
        qk_norms=(w.get("q_norm"), w.get("k_norm")),
        qk_eps=1e-5,
        post_norms=(w.get("post_attn"), w.get("post_mlp")),
        glu=spec.get("glu", "silu"),
        window=spec.get("window"),
        scale=spec.get("scale"),
        rotary_dim=spec.get("rot"),
        softcap=spec.get("softcap"),
    )


def _rows_rope(pos, rd=D):
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).double() / rd))
    ang = torch.tensor(pos).double()[:, None] * inv
    return ang.cos().float().contiguous(), ang.sin().float().contiguous()


SPECS = {
    "llama": {},
    "qk-norm": {"qk": True},
    "gemma3-local": {"qk": True, "post": True, "glu": "gelu_tanh", "window": 8, "scale": 0.1},
    "gemma3-global": {"qk": True, "post": True, "glu": "gelu_tanh", "scale": 0.1},
    "window": {"window": 5},
    "partial-rotary": {"rot": 8},  # Phi-3: RoPE over half of each head
    "partial-qk-norm": {"rot": 6, "qk": True},
    "gemma2": {"post": True, "glu": "gelu_tanh", "window": 8, "scale": 0.1, "softcap": 2.0},
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("pos", [[13], [3, 12, 20]])
def test_contiguous_cache_step_equals_torch(name, pos):
    spec = SPECS[name]
    w = _layer(spec)
    M, S = len(pos), 32
    g = torch.Generator().manual_seed(len(pos))
    K, V = torch.randn(M, Hkv, S, D, generator=g), torch.randn(M, Hkv, S, D, generator=g)
    K2, V2 = K.clone(), V.clone()
    x = torch.randn(M, C, generator=g)
    cos, sin = _rows_rope(pos, spec.get("rot", D))
    plan = _plan(w, spec)
    base = torch.arange(M, dtype=torch.int64) * (Hkv * S * D)
    rows = (base, torch.tensor(pos), S * D, D)
    got = kernel_layer.run_stack([(plan, cos, sin, K, V, rows)], x)
    want = _reference(w, spec, x, lambda m: K2[m], lambda m: V2[m], lambda m, p: p, pos, cos, sin)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(K, K2, rtol=1e-5, atol=1e-5)  # the new keys written where the reference put them


@pytest.mark.parametrize("bs", [4, 3])
@pytest.mark.parametrize("name", ["gemma3-local", "gemma2"])
def test_paged_table_window_starting_inside_a_block_equals_torch(bs, name):
    """A paged pool's blocks in scattered order; the window of 8 keys starts mid-block for some rows."""
    spec = SPECS[name]
    w = _layer(spec)
    pos = [5, 14, 21]
    M, width = len(pos), 8
    NB = M * width
    g = torch.Generator().manual_seed(9)
    K, V = torch.randn(Hkv, NB * bs, D, generator=g), torch.randn(Hkv, NB * bs, D, generator=g)
    K2, V2 = K.clone(), V.clone()
    table = torch.randperm(NB, generator=g).view(M, width).to(torch.int64)
    x = torch.randn(M, C, generator=g)
    cos, sin = _rows_rope(pos)
    rows = (None, torch.tensor(pos), NB * bs * D, D, table, bs)
    got = kernel_layer.run_stack([(_plan(w, spec), cos, sin, K, V, rows)], x)

    def slot(m, p):
        return int(table[m, p // bs]) * bs + p % bs

    want = _reference(w, spec, x, lambda m: K2, lambda m: V2, slot, pos, cos, sin)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pos", [[3], [8, 30]])
@pytest.mark.parametrize("name", ["gemma3-local", "gemma2"])
def test_ring_of_window_rows_equals_torch(pos, name):
    """A cache that keeps only a layer's last R = W keys (key p at row p % R): rows' ring, ST_RING."""
    spec = SPECS[name]
    R = spec["window"]
    w = _layer(spec)
    M = len(pos)
    g = torch.Generator().manual_seed(4)
    K, V = torch.randn(M, Hkv, R, D, generator=g), torch.randn(M, Hkv, R, D, generator=g)
    K2, V2 = K.clone(), V.clone()
    x = torch.randn(M, C, generator=g)
    cos, sin = _rows_rope(pos)
    plan = _plan(w, spec)
    base = torch.arange(M, dtype=torch.int64) * (Hkv * R * D)
    rows = (base, torch.tensor(pos), R * D, D, None, 0, R)  # a cache's ring claim (cache/sliding.py)
    y = kernel_layer.run_stack([(plan, cos, sin, K, V, rows)], x)
    want = _reference(w, spec, x, lambda m: K2[m], lambda m: V2[m], lambda m, p: p % R, pos, cos, sin)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


def test_two_layers_with_their_own_rotaries_in_one_bound_stack():
    """StackCall.at with cos/sin per layer (Gemma's local and global rotaries) equals the layers'
    own entries run one by one."""
    specs = [SPECS["gemma3-local"], SPECS["gemma3-global"]]
    ws = [_layer(s) for s in specs]
    plans = [_plan(w, s) for w, s in zip(ws, specs)]
    M, S, pos = 2, 24, [6, 17]
    g = torch.Generator().manual_seed(5)
    caches = [(torch.randn(M, Hkv, S, D, generator=g), torch.randn(M, Hkv, S, D, generator=g)) for _ in plans]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    x = torch.randn(M, C, generator=g)
    ropes = [_rows_rope(pos), tuple(t * 0.5 for t in _rows_rope(pos))]  # any two tables
    base = torch.arange(M, dtype=torch.int64) * (Hkv * S * D)
    pos_t = torch.tensor(pos)
    call = kernel_layer.StackCall([(p, k, v, S * D, D) for p, (k, v) in zip(plans, caches)])
    got = kernel_layer.run_stack(call.at((base, pos_t), [r[0] for r in ropes], [r[1] for r in ropes]), x)
    h = x
    for p, (k, v), (cos, sin) in zip(plans, copies, ropes):
        h = kernel_layer.run_stack([(p, cos, sin, k, v, (base, pos_t, S * D, D))], h)
    assert torch.equal(got, h)


@pytest.mark.parametrize("M", [1, 9, 70])
def test_qk_norm_rope_rows_equal_torch(M):
    """kernels.qk_norm_rope_ (a prefill's rows): each q and k head normed over D, then rotated; v untouched."""
    g = torch.Generator().manual_seed(M)
    y = torch.randn(M, (H + 2 * Hkv) * D, generator=g) * 3
    qn, kn = 1 + 0.3 * torch.randn(D, generator=g), 1 + 0.3 * torch.randn(D, generator=g)
    cos, sin = _rows_rope(list(range(M)))
    want = y.double().clone()
    q = _rms(want[:, : H * D].view(M, H, D), qn.double(), 1e-5)
    k = _rms(want[:, H * D : (H + Hkv) * D].view(M, Hkv, D), kn.double(), 1e-5)
    want[:, : H * D] = _rope(q, cos.double()[:, None], sin.double()[:, None]).reshape(M, -1)
    want[:, H * D : (H + Hkv) * D] = _rope(k, cos.double()[:, None], sin.double()[:, None]).reshape(M, -1)
    kernels.qk_norm_rope_(y, (H, Hkv, D), qn, kn, 1e-5, cos, sin)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
