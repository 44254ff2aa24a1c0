"""AttentionConfig / ModelConfig validation, presets and overrides."""

import dataclasses

import pytest

from headwise.core.config import ALIASES, PRESETS, AttentionConfig, ModelConfig, get_preset, parse_overrides


def tiny(**changes) -> ModelConfig:
    fields = dict(name="tiny", arch="llama", vocab_size=100, d_model=64, num_layers=2, num_heads=4, d_ff=128,
                  max_positions=32)  # fmt: skip
    return ModelConfig(**{**fields, **changes})


# --- AttentionConfig -----------------------------------------------------------


@pytest.mark.parametrize(
    "kv, kind, group", [(None, "MHA", 1), (12, "MHA", 1), (4, "GQA", 3), (2, "GQA", 6), (1, "MQA", 12)]
)
def test_attention_kind_and_group_size(kv, kind, group):
    a = AttentionConfig(d_model=768, num_heads=12, num_kv_heads=kv)
    assert (a.kind, a.group_size, a.head_dim) == (kind, group, 64)
    assert a.num_kv_heads == 12 // group


def test_heads_not_dividing_names_the_numbers():
    with pytest.raises(ValueError, match="num_heads=12 is not divisible by num_kv_heads=5"):
        AttentionConfig(d_model=768, num_heads=12, num_kv_heads=5)
    with pytest.raises(ValueError, match="num_heads=12 is not divisible by num_kv_heads=5"):
        tiny(num_heads=12, d_model=768, num_kv_heads=5)


def test_width_not_dividing_needs_head_dim():
    with pytest.raises(ValueError, match="d_model=770 is not divisible by num_heads=12; pass head_dim"):
        AttentionConfig(d_model=770, num_heads=12)
    assert AttentionConfig(d_model=770, num_heads=12, head_dim=64).head_dim == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=0, num_heads=1), "d_model must be a positive int, got 0"),
        (dict(d_model=64, num_heads=-2), "num_heads must be a positive int, got -2"),
        (dict(d_model=64, num_heads=4, num_kv_heads=0), "num_kv_heads must be a positive int"),
        (dict(d_model=64, num_heads=4, dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    ],
)
def test_attention_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**kwargs)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_preset("gpt2").num_layers = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttentionConfig(64, 4).num_heads = 2


# --- ModelConfig -----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mlp="relu"), "mlp='relu' is not one of gelu, swiglu"),
        (dict(norm="batchnorm"), "norm='batchnorm' is not one of layernorm, rmsnorm"),
        (dict(positions="alibi"), "positions='alibi' is not one of learned, rope"),
        (dict(arch="mamba"), "arch='mamba' is not one of"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(type_vocab_size=-1), "type_vocab_size=-1 must be >= 0"),
    ],
)
def test_model_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**changes)


def test_model_attention_view():
    cfg = get_preset("llama-2-70b")
    assert cfg.attention == AttentionConfig(8192, 64, 8, 128, bias=False)
    assert get_preset("gpt2").attention.bias is True


# The seed's table of per-head widths (BERT-base 64, GPT-2 small 64, GPT-3 128,
# Llama-2 7B 128) is an independent reference for D = C / H.
@pytest.mark.parametrize(
    "name, C, H, D",
    [("bert-base", 768, 12, 64), ("gpt2", 768, 12, 64), ("gpt3-175b", 12288, 96, 128), ("llama-2-7b", 4096, 32, 128)],
)
def test_presets_match_seed_table(name, C, H, D):
    cfg = get_preset(name)
    assert (cfg.d_model, cfg.num_heads, cfg.head_dim) == (C, H, D)


def test_shipped_models_shapes():
    smol, minilm = get_preset("smollm2-135m"), get_preset("all-minilm-l6-v2")
    assert (smol.num_layers, smol.d_model, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 576, 9, 3, 64)
    assert smol.attention.kind == "GQA" and smol.tie_embeddings
    assert (minilm.num_layers, minilm.d_model, minilm.num_heads, minilm.head_dim) == (6, 384, 12, 32)
    assert minilm.attention.kind == "MHA" and minilm.pooler and not minilm.causal


@pytest.mark.parametrize(
    "alias, name",
    [("GPT2-small", "gpt2"), ("gpt-2", "gpt2"), ("llama2-7b", "llama-2-7b"), ("Llama-2-70B", "llama-2-70b"),
     ("meta-llama/Llama-2-7b-hf", "llama-2-7b"), ("bert_base", "bert-base"), ("  SmolLM2  ", "smollm2-135m")],
)  # fmt: skip
def test_get_preset_aliases(alias, name):
    assert get_preset(alias) is PRESETS[name]


def test_every_alias_resolves():
    for alias, name in ALIASES.items():
        assert get_preset(alias) is PRESETS[name]


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'") as err:
        get_preset("gpt5")
    for name in PRESETS:
        assert name in str(err.value)


# --- overrides -----------------------------------------------------------------


def test_override_rederives_head_dim_and_keeps_mha():
    bert = get_preset("bert-base")
    small = bert.override(d_model=512, num_heads=8)
    assert (small.head_dim, small.num_kv_heads) == (64, 8)
    assert bert.override(num_heads=16).num_kv_heads == 16  # MHA stays MHA


def test_override_keeps_pinned_values():
    smol = get_preset("smollm2-135m")  # D = 64 = 576 / 9: derived, so it follows
    assert smol.override(d_model=1152).head_dim == 128
    assert smol.override(d_model=1152, head_dim=64).head_dim == 64
    assert smol.override(num_heads=12).num_kv_heads == 3  # GQA keeps its KV heads
    with pytest.raises(ValueError, match="num_heads=10 is not divisible by num_kv_heads=3"):
        smol.override(num_heads=10, head_dim=64)


def test_override_unknown_field():
    with pytest.raises(ValueError, match="unknown config field.*n_layer.*valid: name, arch"):
        get_preset("gpt2").override(n_layer=3)


def test_parse_overrides_types():
    got = parse_overrides(["num_layers=24", "tie-embeddings=false", "mlp=swiglu", "num_kv_heads=none", "d_ff=5_632"])
    assert got == dict(num_layers=24, tie_embeddings=False, mlp="swiglu", num_kv_heads=None, d_ff=5632)


@pytest.mark.parametrize(
    "item, message",
    [
        ("num_layers", "is not KEY=VALUE"),
        ("layers=3", "unknown config field 'layers'"),
        ("num_layers=abc", "num_layers expects an int, got 'abc'"),
        ("pooler=maybe", "pooler expects true/false, got 'maybe'"),
        ("d_model=none", "d_model expects an int"),
    ],
)
def test_parse_overrides_errors(item, message):
    with pytest.raises(ValueError, match=message):
        parse_overrides([item])


def test_presets_module_is_plain_data():
    """presets.py holds fields only: no imports (so config.py reads it without a cycle, and
    `headwise plan` pulls in no torch), and every entry is built into PRESETS."""
    import ast
    import pathlib

    from headwise.core import presets

    tree = ast.parse(pathlib.Path(presets.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [f["name"] for f in presets.PRESET_FIELDS] == list(PRESETS)
    seventy = get_preset("llama-2-70b")  # a `base` entry: the 7B's fields with its own changes
    assert (seventy.num_kv_heads, seventy.vocab_size, seventy.positions) == (8, 32000, "rope")
