"""The gateway config: the example file parses, mistakes are named."""

from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the [serve] extra")

from headwise.serve.config import ConfigError, default_config, load_config, parse_config  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway.toml"


def test_example_config_parses():
    config = load_config(EXAMPLE)
    assert config.server.host == "127.0.0.1"
    assert {"smollm2", "smollm2-int8", "minilm"} <= set(config.models)
    assert config.models["smollm2-int8"].cache == "int8"
    for route in config.routes.values():
        for t in route.targets:
            assert t.target in config.model_names()


def test_default_serves_the_builtin_models_on_loopback():
    config = default_config()
    assert config.server.host == "127.0.0.1"
    assert set(config.models) == {"smollm2-135m-instruct", "all-minilm-l6-v2"}
    assert default_config(port=9001).server.port == 9001


@pytest.mark.parametrize(
    "data, message",
    [
        ({"models": {"m": {"cache": "ring"}}}, "cache = 'ring'"),
        ({"models": {"m": {"cache": "contiguous"}}}, "needs the paged block pool"),
        ({"models": {"m": {"max_num_seqs": 0}}}, "[models.m] max_num_seqs must be a positive int (>= 1), got 0"),
        (
            {"models": {"m": {"max_num_seqs": 8, "max_num_batched_tokens": 4}}},
            "[models.m] max_num_batched_tokens=4 < max_num_seqs=8",
        ),
        ({"models": {"m": {"num_blocks": -1}}}, "num_blocks must be a positive int or None"),
        ({"models": {"m": {"memory_budget_bytes": "1GiB"}}}, "memory_budget_bytes must be a positive int or None"),
        ({"models": {"m": {"sorce": "x"}}}, "unknown key(s) sorce"),
        ({"modles": {}}, "unknown table(s) modles"),
        ({}, "serves nothing"),
        ({"providers": {"p": {"base_url": "ftp://x", "models": ["a"]}}}, "not an http(s) URL"),
        ({"providers": {"p": {"base_url": "http://x/v1", "models": []}}}, "lists no models"),
        (
            {"providers": {"p": {"base_url": "http://x/v1", "models": ["a"], "api": "grpc"}}},
            "[providers.p] api = 'grpc'; choose one of openai, anthropic",
        ),
        ({"providers": {"p": {"base_url": "http://x/v1", "models": ["a"], "timeout": 0}}}, "timeout must be > 0"),
        ({"models": {"m": {}}, "routes": {"r": {"targets": ["nope"]}}}, "target 'nope' is neither"),
        ({"models": {"m": {}}, "routes": {"r": {"targets": [{"target": "m", "weight": 0}]}}}, "weights must be > 0"),
        ({"models": {"m": {}}, "routes": {"m": {"targets": ["m"]}}}, "hide models of the same name"),
    ],
)
def test_config_errors_name_the_problem(data, message):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert message in str(e.value)


def test_provider_api():
    """api names what the provider speaks; config.py still exports what moved to config_providers.py."""
    from headwise.serve.config import Provider

    providers = {
        "o": {"base_url": "http://x/v1", "models": ["a"]},
        "c": {"base_url": "https://api.anthropic.com/v1", "models": ["m"], "api": "anthropic"},
    }
    config = parse_config({"providers": providers})
    assert isinstance(config.providers["c"], Provider)
    assert config.providers["o"].api == "openai" and config.providers["c"].api == "anthropic"
    assert config.providers["c"].anthropic_version == "2023-06-01"
    assert config.model_names() == ["o/a", "c/m"]


def test_keys_come_from_the_env(monkeypatch):
    config = parse_config({"server": {"api_key_env": "MY_KEYS"}, "models": {"m": {}}})
    monkeypatch.delenv("MY_KEYS", raising=False)
    assert config.server.keys() == ()
    monkeypatch.setenv("MY_KEYS", "a, b,")
    assert config.server.keys() == ("a", "b")


def test_cli_override_and_bad_file(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text('[models.m]\nsource = "smollm2-135m-instruct"\n[server]\nport = 1234\n')
    assert load_config(f).server.port == 1234
    assert load_config(f, host="0.0.0.0", port=5).server.port == 5
    f.write_text("[models.m\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
