"""The planner with per-layer windows: KV bytes per layer type, a sequence's KV at a context
(a sliding-window layer holds only its window), the pool's groups and what they bound.

The expected numbers are written out from the formulas (2 x Hkv x D x bytes per layer and token),
not taken from the planner's own helpers."""

from headwise.core.config import ModelConfig
from headwise.core.plan import kv_bytes_at, kv_layer_groups, kv_layer_types, plan
from headwise.core.plan_report import format_plan
from headwise.runtime.config import EngineConfig


def gemma3_270m(**kw) -> ModelConfig:
    return ModelConfig(
        name="gemma-3-270m", arch="llama", vocab_size=262144, d_model=640, num_layers=18, num_heads=4,
        num_kv_heads=1, head_dim=256, d_ff=2048, max_positions=32768, mlp="swiglu", norm="rmsnorm",
        positions="rope", layer_windows=((512,) * 5 + (None,)) * 3, **kw,
    )  # fmt: skip


PER_LAYER = 2 * 1 * 256 * 2  # K and V, 1 KV head x D 256, bf16


def test_layer_types_and_groups():
    cfg = gemma3_270m()
    assert kv_layer_types(cfg) == [(None, 3), (512, 15)]
    assert kv_layer_groups(cfg) == (3, [(None, 1), (512, 5)])
    plain = cfg.override(layer_windows=None)
    assert kv_layer_groups(plain) == (18, [(None, 1)])


def test_a_4096_token_gemma3_sequence_holds_under_0_3x_all_global():
    cfg = gemma3_270m()
    hybrid, full = kv_bytes_at(cfg, 4096), kv_bytes_at(cfg.override(layer_windows=None), 4096)
    assert hybrid == (3 * 4096 + 15 * 512) * PER_LAYER
    assert full == 18 * 4096 * PER_LAYER
    assert hybrid / full <= 0.3  # 0.2708
    assert kv_bytes_at(cfg, 100) == 18 * 100 * PER_LAYER  # inside the window every layer holds every token


def test_plan_reports_each_layer_type_and_its_max_context():
    cfg = gemma3_270m()
    p = plan(cfg, context=4096, memory="2GiB")
    assert p.kv_bytes == (3 * 4096 + 15 * 512) * PER_LAYER
    assert p.kv_layer_types == [(None, 3, 3 * PER_LAYER), (512, 15, 15 * PER_LAYER)]
    free = p.memory - p.weight_bytes
    assert kv_bytes_at(cfg, p.max_context) <= free < kv_bytes_at(cfg, p.max_context + 1)
    assert p.max_batch == free // p.kv_bytes
    text = format_plan(p)
    assert "3 global layers" in text and "15 sliding layers (window 512)" in text
    assert "blocks of 16 tokens x 3 layers" in text
    assert p.kv_pool_blocks == free // (3 * PER_LAYER * 16)


def test_plain_models_plan_as_before():
    cfg = gemma3_270m().override(layer_windows=None)
    p = plan(cfg, context=4096, memory="2GiB")
    free = p.memory - p.weight_bytes
    assert p.kv_bytes == 18 * 4096 * PER_LAYER and p.max_context == free // (18 * PER_LAYER)
    assert p.kv_pool_blocks == free // (18 * PER_LAYER * 16)
    assert "global layers" not in format_plan(p)


def test_engine_max_model_len_counts_the_groups():
    """A pool of 1000 blocks (16 tokens x 3 layers): the null block, five windowed groups that
    each hold (511 + a 512-token chunk) / 16 + 1 blocks, and the one global group the rest."""
    cfg = gemma3_270m()
    c = EngineConfig(num_blocks=1000, block_size=16, max_num_batched_tokens=512)
    windows = 5 * (-(-(511 + 512) // 16) + 1)
    assert c.max_model_len(cfg) == (1000 - 1 - windows) * 16
    assert EngineConfig(num_blocks=100, block_size=16).max_model_len(cfg.override(layer_windows=None)) == 1600


def test_attention_flops_count_a_windowed_layers_window():
    """A token at position 4096 attends to 4096 keys in a global layer and 512 in a local one."""
    from headwise.core.plan import flops_per_token

    cfg = gemma3_270m()
    H, D = 4, 256
    assert flops_per_token(cfg, 4096)["attention"] == 4 * H * D * (3 * 4096 + 15 * 512)
    assert flops_per_token(cfg, 100)["attention"] == 4 * H * D * 18 * 100


def test_a_budget_under_one_block_names_the_groups_layers():
    import pytest

    per_token = 3 * 2 * 256 * 4  # a block's 3 layers, K and V, fp32
    with pytest.raises(
        ValueError, match=rf"\({16 * per_token} bytes: 16 tokens x {per_token} bytes per token of its 3"
    ):
        EngineConfig(memory_budget_bytes=10).resolve(gemma3_270m(), "float32")
