"""`headwise serve MODEL --weights --kv-dtype --max-model-len --max-num-seqs --served-model-name`: each flag
makes the model a --config file's [models.NAME] table makes (the TOML path is the reference), a flag
beside --config is one line naming the key to set instead, a bad value one line naming the fix."""

import pytest

from headwise.engine import EngineConfig

from headwise.cli.argtypes import Parser
from headwise.cli.serve_flags import add_model_flags, apply_model_flags, token_count
from headwise.serve import parse_config
from headwise.serve.config import ConfigError, default_config, models_config

SMOL, MINILM = "smollm2-135m-instruct", "all-minilm-l6-v2"  # builtin names: nothing is loaded here


def parse(*argv: str):
    """`headwise serve`'s positional MODELs and --config, plus the per-model flags, on the CLI's one-line Parser."""
    p = Parser(prog="headwise serve")
    p.add_argument("models", nargs="*")
    p.add_argument("--config")
    add_model_flags(p)
    return p.parse_args(list(argv))


def served(*argv: str):
    args = parse(*argv)
    return apply_model_flags(models_config(args.models) if args.models else default_config(), args)


def test_the_flags_make_the_model_its_toml_table_makes():
    by_flags = served(SMOL, "--weights", "q8_0", "--kv-dtype", "int8", "--max-model-len", "4K", "--max-num-seqs", "8")
    table = {"source": SMOL, "weights": "q8_0", "cache": "int8", "max_model_len": 4096, "max_num_seqs": 8}
    by_toml = parse_config({"models": {SMOL: table}})
    assert by_flags.models == by_toml.models
    assert by_flags.models[SMOL].engine.kv_dtype == "int8"  # the pool's dtype, as LocalModel gives the engine
    # auto: the engine's own choice (kv_dtype None: 16-bit for quantized weights, else the model's dtype)
    auto = served(SMOL, "--kv-cache-dtype", "auto")  # vLLM's spelling of the flag
    assert auto.models == parse_config({"models": {SMOL: {"cache": "paged"}}}).models
    assert auto.models[SMOL].engine.kv_dtype is None
    for dtype in ("bfloat16", "float16", "float32"):  # K/V stored as named, as EngineConfig(kv_dtype=) takes it
        named = served(SMOL, "--kv-dtype", dtype)
        assert named.models == parse_config({"models": {SMOL: {"cache": dtype}}}).models
        assert named.models[SMOL].engine == EngineConfig(kv_dtype=dtype)


def test_more_sequences_than_a_step_holds_raise_the_step_budget():
    # every running sequence decodes a token per step: the TOML has to say max_num_batched_tokens too
    by_toml = parse_config({"models": {SMOL: {"max_num_seqs": 600, "max_num_batched_tokens": 600}}})
    assert served(SMOL, "--max-num-seqs", "600").models == by_toml.models
    with pytest.raises(ConfigError, match="max_num_batched_tokens=512 < max_num_seqs=600"):
        parse_config({"models": {SMOL: {"max_num_seqs": 600}}})


def test_served_model_names():
    # one MODEL: the first name is its own, the rest aliases it answers to (vLLM's several names)
    one = served(SMOL, "--served-model-name", "gpt-4o-mini,chat")
    assert one.models == parse_config({"models": {"gpt-4o-mini": {"source": SMOL}}}).models
    assert one.model_names() == ["gpt-4o-mini", "chat"]
    assert [t.target for t in one.routes["chat"].targets] == ["gpt-4o-mini"]
    # several MODELs: one name each, in order
    two = served(SMOL, MINILM, "--served-model-name", "chat,embed")
    assert two.models == parse_config({"models": {"chat": {"source": SMOL}, "embed": {"source": MINILM}}}).models
    # no MODEL: the two builtin models, in the order the banner lists them
    assert list(served("--served-model-name", "a,b").models) == ["a", "b"]
    with pytest.raises(ConfigError) as e:
        served(SMOL, MINILM, "--served-model-name", "a,b,c")
    assert "3 name(s) (a, b, c) for 2 models (smollm2-135m-instruct, all-minilm-l6-v2)" in str(e.value)
    assert "\n" not in str(e.value)


def test_no_flag_leaves_the_config_as_it_was():
    config = models_config([SMOL])
    assert apply_model_flags(config, parse(SMOL)) is config


def test_a_flag_beside_config_names_the_key_to_set_in_the_file():
    args = parse("--config", "gw.toml", "--max-model-len", "2k", "--kv-dtype", "int8", "--served-model-name", "x")
    with pytest.raises(ConfigError) as e:
        apply_model_flags(default_config(), args)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--kv-dtype, --max-model-len, --served-model-name apply to MODEL arguments, not to")
    assert "max_model_len = 2000" in message and "cache = 'int8'" in message and "[models.x]" in message


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["--kv-dtype", "fp8"], "choose auto"),
        (["--max-model-len", "0"], "e.g. 4096, 4k (4000) or 4K (4096)"),
        (["--max-model-len", "1.5"], "e.g. 4096"),
        (["--max-num-seqs", "-2"], "must be >= 1"),
        (["--weights", "q3"], "is not one of auto, fp32"),
        (["--served-model-name", "a,,b"], "separated by commas"),
        (["--served-model-name", "a,a"], "names a twice"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(capsys, argv, fix):
    with pytest.raises(SystemExit) as exit:
        parse(SMOL, *argv)
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"headwise serve: error: argument {argv[0]}") and fix in line, line


def test_max_model_len_reads_sizes_as_vllm_does():
    # vLLM's --max-model-len help: "1k -> 1000, 1K -> 1024, 25.6k -> 25,600"
    assert [token_count(t) for t in ("1k", "1K", "25.6k", "4096", "2M")] == [1000, 1024, 25600, 4096, 2 * 1024**2]
