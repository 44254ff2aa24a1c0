"""EngineConfig: validated once, with errors that name the field; and the same config drives
the Engine, the server's [models.NAME] limits and the planner's pool sizing."""

import dataclasses

import pytest

from headwise import Engine, SamplingParams
from headwise.engine import EngineConfig
from headwise.core.plan import kv_pool_blocks, plan
from headwise.serve.config import ConfigError, parse_config

from .conftest import ragged_prompts


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_num_seqs", 0, "max_num_seqs must be a positive int (>= 1), got 0"),
        ("block_size", -4, "block_size must be a positive int (>= 1), got -4"),
        ("max_num_batched_tokens", 2.5, "max_num_batched_tokens must be a positive int (>= 1), got 2.5"),
        ("max_waiting_requests", True, "max_waiting_requests must be a positive int (>= 1), got True"),
        ("num_blocks", 0, "num_blocks must be a positive int or None (sized for you), got 0"),
        ("max_waiting_tokens", -1, "max_waiting_tokens must be a positive int or None (sized for you), got -1"),
        (
            "memory_budget_bytes",
            "1GiB",
            "memory_budget_bytes must be a positive int or None (sized for you), got '1GiB'",
        ),
        (
            "kv_dtype",
            "fp8",
            "kv_dtype must be None (16-bit K/V for a model with quantized weights, the compute dtype otherwise), "
            "'float32', 'bfloat16', 'float16' or 'int8', got 'fp8'",
        ),
    ],
)
def test_each_field_is_checked_and_named(field, value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})
    assert message in str(e.value)


def test_cross_field_checks_say_the_fix():
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 < max_num_seqs=16: .* raise max_num_batched_tokens"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_num_seqs = 3  # frozen: validated once


def test_budget_that_holds_no_block_names_it(tiny_gpt2):
    cfg = tiny_gpt2.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    with pytest.raises(
        ValueError,
        match=f"memory_budget_bytes=10 does not hold one KV block \\({16 * per_token} "
        f"bytes: 16 tokens x {per_token} bytes per token\\)",
    ):
        EngineConfig(memory_budget_bytes=10).resolve(cfg, "float32")


def test_keywords_and_config_build_the_same_engine(tiny_gpt2):
    by_kw = Engine(tiny_gpt2, max_num_seqs=4, num_blocks=32, block_size=4, max_num_batched_tokens=16)
    config = EngineConfig(max_num_seqs=4, num_blocks=32, block_size=4, max_num_batched_tokens=16)
    by_config = Engine(tiny_gpt2, config=config)
    assert by_kw.config == by_config.config == config.replace(max_waiting_tokens=4 * 32 * 4)
    assert Engine(tiny_gpt2, config=config, max_num_seqs=2).config.max_num_seqs == 2  # keywords change it
    with pytest.raises(TypeError, match="unknown engine setting\\(s\\) max_seqs"):
        Engine(tiny_gpt2, max_seqs=4)
    prompts = ragged_prompts(96, seed=2)[:4]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    assert [o.token_ids for o in by_kw.generate(prompts, greedy)] == [
        o.token_ids for o in by_config.generate(prompts, greedy)
    ]


@pytest.mark.parametrize("cache, kv_dtype, scale_bytes", [("paged", None, 0), ("int8", "int8", 4)])
def test_one_config_drives_engine_server_and_plan(tiny_llama, cache, kv_dtype, scale_bytes):
    """A memory budget: the engine's pool, the planner's pool and the server's engine agree,
    and all equal the count by hand: budget // (block_size x bytes per token)."""
    cfg = tiny_llama.config
    budget, block_size = 300_000, 8
    elem = 1 if kv_dtype else 4  # int8 / fp32 K and V
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * elem + scale_bytes)
    by_hand = budget // (block_size * per_token)
    config = EngineConfig(
        max_num_seqs=4, block_size=block_size, max_num_batched_tokens=32, memory_budget_bytes=budget, kv_dtype=kv_dtype
    )
    engine = Engine(tiny_llama, config=config)
    assert engine.cache.num_blocks == by_hand
    assert engine.cache.memory_bytes() <= budget
    assert kv_pool_blocks(cfg, budget, block_size=block_size, dtype=kv_dtype or "float32") == by_hand
    dtype = kv_dtype or "float32"
    weights = plan(cfg, dtype=dtype).weight_bytes
    assert plan(cfg, dtype=dtype, memory=weights + budget, block_size=block_size).kv_pool_blocks == by_hand
    served = parse_config(
        {
            "models": {
                "m": {
                    "source": "x",
                    "cache": cache,
                    "max_num_seqs": 4,
                    "block_size": block_size,
                    "max_num_batched_tokens": 32,
                    "memory_budget_bytes": budget,
                }
            }
        }
    ).models["m"]
    assert isinstance(served.engine, EngineConfig) and served.engine == config
    from headwise.serve.local import LocalRuntime

    assert LocalRuntime(served)._make_engine(tiny_llama).cache.num_blocks == by_hand


def test_server_config_errors_come_from_engine_config():
    with pytest.raises(ConfigError, match=r"\[models.m\] max_num_batched_tokens=4 < max_num_seqs=8"):
        parse_config({"models": {"m": {"max_num_seqs": 8, "max_num_batched_tokens": 4}}})
    with pytest.raises(ConfigError, match=r"\[models.m\]: unknown key\(s\) kv_dtype; known: .*memory_budget_bytes"):
        parse_config({"models": {"m": {"kv_dtype": "int8"}}})  # the file says cache = "int8"
