"""Parameter, FLOP and KV-cache counts against published figures and torch modules."""

import argparse
import ast
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from headwise.core.config import PRESETS, AttentionConfig, ModelConfig, get_preset
from headwise.core.plan import (
    attention_params,
    count_params,
    dtype_bytes,
    flops_per_token,
    fmt_bytes,
    fmt_count,
    kv_bytes_per_token,
    mlp_params,
    parse_size,
    plan,
)
from headwise.core.plan_report import add_cli

GiB = 2**30
META = torch.device("meta")  # shapes without storage: a 70B layer costs nothing

# --- parameter totals vs published counts ------------------------------------------

# Exact counts of the released checkpoints: sum(p.numel()) over the Hugging Face
# transformers models GPT2Model("gpt2"), BertModel("bert-base-uncased", pooler
# included) and LlamaForCausalLM("meta-llama/Llama-2-{7,70}b-hf"). These are
# counted from the real weight files, so they check our formulas independently.
EXACT = {"gpt2": 124_439_808, "bert-base": 109_482_240, "llama-2-7b": 6_738_415_616, "llama-2-70b": 68_976_648_192}
# Headline numbers: GPT-2 small 124M (openai/gpt-2 README: the paper's "117M"
# was a counting error), BERT-base 110M (Devlin et al. 2018, section 3), GPT-3
# 175.0B (Brown et al. 2020, Table 2.1), Llama 2 "7B" / "70B" (Touvron et al.
# 2023; 70B is 68.98B, so 69.0B is the 1% reference), SmolLM2-135M and
# all-MiniLM-L6-v2 22.7M (their Hugging Face model pages).
PUBLISHED = {
    "gpt2": 124e6,
    "bert-base": 110e6,
    "gpt3-175b": 175.0e9,
    "llama-2-7b": 6.74e9,
    "llama-2-70b": 69.0e9,
    "smollm2-135m": 135e6,
    "all-minilm-l6-v2": 22.7e6,
}


@pytest.mark.parametrize("name", EXACT)
def test_total_matches_checkpoint_exactly(name):
    assert count_params(get_preset(name))["total"] == EXACT[name]


@pytest.mark.parametrize("name", PUBLISHED)
def test_total_within_1pct_of_published(name):
    total = count_params(get_preset(name))["total"]
    assert abs(total - PUBLISHED[name]) / PUBLISHED[name] < 0.01, fmt_count(total)


def test_parts_sum_to_total():
    for cfg in PRESETS.values():
        c = count_params(cfg)
        assert c["total"] == sum(v for k, v in c.items() if k != "total")


def test_untied_head_counted_once():
    llama, gpt2 = count_params(get_preset("llama-2-7b")), count_params(get_preset("gpt2"))
    assert llama["lm_head"] == llama["embeddings"] == 32000 * 4096
    assert gpt2["lm_head"] == 0  # tied to wte
    assert count_params(get_preset("bert-base"))["other"] == 768 * 768 + 768  # pooler


# --- per-layer counts vs torch modules on the meta device ------------------------------


def numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def torch_attention(C: int, H: int, Hkv: int, D: int, bias: bool) -> int:
    with META:
        return numel(nn.Linear(C, H * D, bias), nn.Linear(C, Hkv * D, bias), nn.Linear(C, Hkv * D, bias),
                     nn.Linear(H * D, C, bias))  # fmt: skip


def torch_mlp(C: int, F: int, kind: str, bias: bool) -> int:
    with META:
        branches = [nn.Linear(C, F, bias) for _ in range(2 if kind == "swiglu" else 1)]  # gate, up
        return numel(*branches, nn.Linear(F, C, bias))


@pytest.mark.parametrize("name", PRESETS)
def test_layer_counts_match_torch_linears(name):
    cfg = get_preset(name)
    a = cfg.attention
    assert attention_params(a) == torch_attention(cfg.d_model, a.num_heads, a.num_kv_heads, a.head_dim, a.bias)
    assert mlp_params(cfg) == torch_mlp(cfg.d_model, cfg.d_ff, cfg.mlp, cfg.mlp_bias)


def test_llama_2_70b_layer_against_torch():
    # GQA: q_proj (8192, 8192), k_proj and v_proj (8192, 1024), o_proj (8192, 8192)
    cfg = get_preset("llama-2-70b")
    assert attention_params(cfg.attention) == torch_attention(8192, 64, 8, 128, bias=False) == 150_994_944
    assert mlp_params(cfg) == torch_mlp(8192, 28672, "swiglu", bias=False) == 704_643_072
    C, H, Hkv, D = 8192, 64, 8, 128
    assert attention_params(cfg.attention) == 2 * C * H * D + 2 * C * Hkv * D


@pytest.mark.parametrize("name", ["llama-2-7b", "gpt3-175b"])
def test_mha_without_bias_is_4C2(name):
    cfg = get_preset(name).override(attn_bias=False)
    assert attention_params(cfg.attention) == 4 * cfg.d_model**2
    assert count_params(cfg)["attention"] == cfg.num_layers * 4 * cfg.d_model**2


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(1, 32),
    G=st.sampled_from([1, 2, 4, 8]),
    D=st.integers(1, 96),
    C=st.integers(1, 512),
    bias=st.booleans(),
)
def test_attention_params_any_shape(H, G, D, C, bias):
    H = H * G  # G query heads per KV head
    a = AttentionConfig(C, H, num_kv_heads=H // G, head_dim=D, bias=bias)
    assert attention_params(a) == torch_attention(C, H, H // G, D, bias)


def test_whole_model_against_torch_skeleton():
    """smollm2-135m (GQA, tied, RMSNorm) built from torch modules on meta."""
    cfg = get_preset("smollm2-135m")
    C, L = cfg.d_model, cfg.num_layers
    with META:
        embed = nn.Embedding(cfg.vocab_size, C)  # lm_head reuses it
        norms = [nn.RMSNorm(C) for _ in range(2 * L + 1)]
    total = numel(embed, *norms) + L * (torch_attention(C, 9, 3, 64, False) + torch_mlp(C, cfg.d_ff, "swiglu", False))
    assert count_params(cfg)["total"] == total


# --- FLOPs ---------------------------------------------------------------------------


def test_flops_are_two_per_weight_plus_attention():
    # Kaplan et al. 2020 / Hoffmann et al. 2022: forward ~ 2N + 2 * 2 * L * context * H * D
    cfg = get_preset("llama-2-7b")  # no biases, untied: every weight matrix is one matmul
    pc, fl = count_params(cfg), flops_per_token(cfg, 4096)
    assert fl["total"] == 2 * (pc["attention"] + pc["mlp"] + pc["lm_head"]) + 4 * 32 * 4096 * 32 * 128
    assert fl["attention"] == 2 * 2 * 4096 * 32 * 128 * 32
    assert flops_per_token(cfg, 2048)["attention"] * 2 == fl["attention"]  # linear in context


def test_encoder_has_no_lm_head_flops():
    assert flops_per_token(get_preset("bert-base"), 512)["lm_head"] == 0


# --- KV cache and memory --------------------------------------------------------------


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(get_preset("llama-2-7b"), "bf16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert kv_bytes_per_token(get_preset("llama-2-70b"), "bfloat16") == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_bytes_per_token(get_preset("llama-2-7b"), "fp32") == 1024 * 1024
    assert kv_bytes_per_token(get_preset("smollm2-135m"), "int8") == 2 * 30 * 3 * 64


def test_encoder_reports_kv_but_keeps_none():
    p = plan(get_preset("bert-base"), memory="16GiB")
    assert p.kv_bytes_per_token == 2 * 12 * 12 * 64 * 2 and p.kv_bytes == 0
    assert p.max_context is None and p.fits
    assert any("no KV cache at inference" in n for n in p.notes)


@settings(max_examples=50, deadline=None)
@given(
    name=st.sampled_from(["llama-2-7b", "llama-2-70b", "smollm2-135m", "gpt2"]),
    memory=st.integers(1, 200 * GiB),
    batch=st.integers(1, 64),
    context=st.integers(1, 32768),
    dtype=st.sampled_from(["bf16", "fp32", "int8"]),
)
def test_max_context_and_batch_are_tight(name, memory, batch, context, dtype):
    cfg = get_preset(name)
    p = plan(cfg, context=context, batch=batch, dtype=dtype, memory=memory)
    kv, weights = kv_bytes_per_token(cfg, dtype), count_params(cfg)["total"] * dtype_bytes(dtype)
    assert p.weight_bytes == weights
    if weights > memory:
        assert p.max_context == p.max_batch == 0 and not p.fits
        return
    assert weights + p.max_context * batch * kv <= memory < weights + (p.max_context + 1) * batch * kv
    assert weights + p.max_batch * context * kv <= memory < weights + (p.max_batch + 1) * context * kv
    assert p.fits == (weights + context * batch * kv <= memory)


def test_reserve_comes_off_the_top():
    cfg = get_preset("llama-2-7b")
    free = 80 * GiB - count_params(cfg)["total"] * 2 - 4 * GiB
    assert plan(cfg, memory="80GiB", reserve="4GiB").max_context == free // (512 * 1024)


def test_weights_that_do_not_fit_say_so():
    p = plan(get_preset("llama-2-70b"), context=4096, batch=8, memory="80GiB")
    assert (p.max_context, p.max_batch, p.fits) == (0, 0, False)
    assert any("do not fit in 80 GiB" in n and ">= 2 such devices" in n for n in p.notes)
    assert plan(get_preset("llama-2-70b"), dtype="int8", memory="80GiB").max_batch > 0


def test_default_context_is_max_positions():
    assert plan(get_preset("gpt2")).context == 1024
    assert any("past the learned position table" in n for n in plan(get_preset("gpt2"), context=2048).notes)


# --- parsing and formatting --------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("24G", 24 * GiB), ("512MiB", 512 * 2**20), ("512 mib", 512 * 2**20),
     ("1.5GiB", 3 * GiB // 2), ("1000", 1000), ("64KB", 64_000), ("2TiB", 2 * 2**40), (123, 123)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "-1GiB", "80iB", "", "8 0GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="cannot read size .*write e.g. 80GiB"):
        parse_size(text)


def test_dtypes():
    assert [dtype_bytes(d) for d in ("fp32", "float32", "FP16", "bfloat16", "int8", "fp8")] == [4, 4, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="unknown dtype 'fp4'; valid: fp32"):
        dtype_bytes("fp4")


def test_human_units():
    assert fmt_count(124_439_808) == "124.44M" and fmt_count(6_738_415_616) == "6.74B"
    assert fmt_bytes(512 * 1024) == "512 KiB" and fmt_bytes(2 * GiB) == "2 GiB" and fmt_bytes(1.5 * GiB) == "1.50 GiB"


# --- CLI ---------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="headwise")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_single_model(capsys):
    code, out, _ = run_cli(capsys, "llama-2-70b", "--context", "4096", "--batch", "8", "--memory", "80GiB")
    assert code == 0
    for figure in ("GQA 64q/8kv", "68.98B", "68,976,648,192", "128.5 GiB", "320 KiB", "10 GiB", "does NOT fit"):
        assert figure in out


def test_cli_fits_and_limits(capsys):
    code, out, _ = run_cli(capsys, "llama2-7b", "--memory", "24GiB", "--batch", "2")
    assert code == 0 and "6.74B" in out and "512 KiB" in out and "4 GiB" in out and "fits" in out
    free = 24 * GiB - 6_738_415_616 * 2
    assert f"{free // (512 * 1024 * 2):,}" in out and f"{free // (512 * 1024 * 4096):,}" in out


def test_cli_all(capsys):
    code, out, _ = run_cli(capsys, "all", "--memory", "80GiB")
    assert code == 0
    for name in PRESETS:
        assert name in out
    for figure in ("109.48M", "124.44M", "174.60B", "6.74B", "68.98B", "512 KiB", "320 KiB", "max batch"):
        assert figure in out


def test_cli_custom_model(capsys):
    sets = ["--set", "num_layers=24", "--set", "d_model=2048", "--set", "num_heads=16", "--set", "num_kv_heads=4"]
    code, out, _ = run_cli(capsys, "llama-2-7b", *sets)
    assert code == 0 and "with num_layers=24" in out and "GQA 16q/4kv heads x D=128" in out
    assert "48 KiB" in out  # 2 * 24 * 4 * 128 * 2 bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gpt2", "--memory", "80 gigs"], "cannot read size '80 gigs'"),
        (["gpt5"], "unknown preset 'gpt5'; valid: bert-base, gpt2"),
        (["gpt2", "--dtype", "fp4"], "unknown dtype 'fp4'"),
        (["gpt2", "--set", "num_kv_heads=5"], "num_heads=12 is not divisible by num_kv_heads=5"),
        (["all", "--set", "num_layers=2"], "--set changes one preset"),
    ],
)
def test_cli_errors(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and message in err


def test_cli_in_a_subprocess():
    script = (
        "import argparse, sys; from headwise.core.plan_report import add_cli; p = argparse.ArgumentParser(prog='headwise'); "
        "add_cli(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    run = subprocess.run([sys.executable, "-c", script, "plan", "gpt2-small"], capture_output=True, text=True)
    assert run.returncode == 0 and "124.44M" in run.stdout
    helped = subprocess.run([sys.executable, "-c", script, "plan", "--help"], capture_output=True, text=True)
    assert "--memory SIZE" in helped.stdout and "headwise plan llama-2-70b" in helped.stdout


@pytest.mark.parametrize("module", ["config.py", "plan.py"])
def test_no_torch_import(module):
    """`headwise plan` must start fast: neither module imports torch."""
    tree = ast.parse((pathlib.Path(__file__).parents[2] / "headwise" / "core" / module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.split(".")[0] == "torch" for name in imported), imported


def test_model_config_from_scratch():
    cfg = ModelConfig(name="mqa", arch="gpt2", vocab_size=1000, d_model=256, num_layers=4, num_heads=8,
                      num_kv_heads=1, d_ff=1024, max_positions=128)  # fmt: skip
    assert cfg.attention.kind == "MQA"
    assert kv_bytes_per_token(cfg, "fp16") == 2 * 4 * 1 * 32 * 2


def test_quantized_weights_match_the_gguf_file():
    """weights="q4_1": the matrices' bytes equal what the shipped Q4_1 GGUF stores for them (its
    block linears are Q4_1; its token embedding is Q8_0, so that one is priced from the file's
    Q8_0 tensor, at 34/32 bytes per value, against plan's q8_0)."""
    import gguf

    from headwise.models.builtin import resolve

    tensors = gguf.GGUFReader(resolve("smollm2")).tensors
    by_type = {}
    for t in tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    cfg = get_preset("smollm2-135m")
    emb = cfg.vocab_size * cfg.d_model
    q4 = plan(cfg, dtype="fp32", weights="q4_1").weight_formats
    q8 = plan(cfg, dtype="fp32", weights="q8_0").weight_formats
    assert q4["q4_1"] - emb // 32 * 20 == by_type["Q4_1"]
    assert q8["q8_0"] * 20 == q4["q4_1"] * 34  # the same blocks of 32, 34 bytes each instead of 20
    assert emb // 32 * 34 == by_type["Q8_0"]
    assert q4["fp32"] == by_type["F32"]  # norms
    with pytest.raises(ValueError, match="q4_1"):
        plan(cfg, weights="q3_xs")


@pytest.mark.parametrize("weights", ["q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q4_k", "q6_k", "q4_0"])
def test_plan_prices_weights_as_headwise_load_holds_them(weights):
    """SmolLM2 loaded with weights= (the shipped file dequantized, then quantized as asked): the bytes
    of its blocks per format, read off the loaded model, are what plan prices for its config, mixes
    and fallbacks included (576-wide rows take Q5_0 / Q5_1 / Q8_0 for the K-quants; a q|k|v of Q5_0
    Q and K beside a Q8_0 V is held as Q8_0)."""
    import warnings

    import headwise
    from headwise.models.linear import weight_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = headwise.load("smollm2", weights=weights)
    held = {k: v for k, v in weight_bytes(model).items() if k != "float32"}
    priced = plan(get_preset("smollm2-135m"), dtype="fp32", weights=weights).weight_formats
    assert held == {k: v for k, v in priced.items() if k != "fp32"}


@pytest.mark.parametrize(
    "weights,gb",
    [("q4_k_s", 3.86), ("q4_k_m", 4.08), ("q5_k_s", 4.65), ("q5_k_m", 4.78), ("q6_k", 5.53), ("q8_0", 7.16)],
)
def test_llama_quantize_mixes_price_llama_2_7b_as_its_published_files(weights, gb):
    """Llama-2-7B in llama-quantize's mixes: the weights' bytes (blocks + fp32 norms) are the sizes of
    the GGUF files of those types published for it (TheBloke/Llama-2-7B-GGUF's table, in GB of 10^9
    bytes, rounded to 10 MB; a file adds under 1 MB of metadata and vocabulary). The mixes' choices
    (the head in Q6_K, V and down projections in Q6_K in 16 of 32 layers for the _m mixes, ...) move
    the size by up to 0.23 GB, so a wrong rule shows."""
    f = plan(get_preset("llama-2-7b"), dtype="fp32", weights=weights).weight_formats
    assert abs(sum(f.values()) / 1e9 - gb) < 0.006, f
