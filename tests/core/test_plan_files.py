"""`headwise plan FILE.gguf` / `plan DIR`: the config comes from the file's metadata (or config.json), and
its counts match what the files hold -- tensor sizes read with the `gguf` and `safetensors` packages,
metadata read with `gguf`'s own reader -- for every family's fixture (made by llama.cpp's converter)."""

import argparse
import json
import math
from pathlib import Path

import gguf
import pytest
from safetensors import safe_open

from headwise.cli import planning
from headwise.core.plan import count_params
from headwise.models.builtin import resolve
from headwise.models.describe import describe

FAMILIES = Path(__file__).resolve().parents[1] / "fixtures" / "families"
NAMES = ["bert", "gemma2", "gemma3", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3"]


def gguf_elements(path: Path) -> int:
    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def safetensors_elements(folder: Path) -> int:
    with safe_open(folder / "model.safetensors", "pt") as f:
        # position_ids: a buffer (0, 1, 2, ...) older BERT checkpoints carry, not a weight
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("position_ids"))


@pytest.mark.parametrize("family", NAMES)
def test_parameters_are_the_tensors_the_files_hold(family):
    # exact: Qwen2's Q/K/V-only biases, Qwen3's and Gemma 3's qk-norms, Gemma's post-norms, BERT's pooler
    # (in the folder; llama.cpp's converter drops it from the GGUF) all counted as the files hold them
    assert count_params(describe(FAMILIES / family).config)["total"] == safetensors_elements(FAMILIES / family)
    gguf_file = FAMILIES / f"{family}.gguf"
    assert count_params(describe(gguf_file).config)["total"] == gguf_elements(gguf_file)


@pytest.mark.parametrize("name", ["qwen2.q8_0.gguf", "gemma3.gguf"])
def test_a_gguf_is_planned_from_its_own_metadata(name):
    path = FAMILIES / name  # written by llama.cpp's converter: Q8_0 (general.file_type 7), F32 (0)
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    d = describe(path)
    c = d.config
    assert (c.num_layers, c.d_model, c.d_ff, c.max_positions) == tuple(
        meta[f"{arch}.{k}"] for k in ("block_count", "embedding_length", "feed_forward_length", "context_length")
    )
    assert (c.num_heads, c.num_kv_heads) == (
        meta[f"{arch}.attention.head_count"],
        meta[f"{arch}.attention.head_count_kv"],
    )
    assert c.head_dim == meta.get(f"{arch}.attention.key_length", c.d_model // c.num_heads)
    assert c.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert c.rope_theta == pytest.approx(meta[f"{arch}.rope.freq_base"])
    file_type = gguf.LlamaFileType(meta["general.file_type"]).name  # MOSTLY_Q8_0, ALL_F32
    assert d.weights == file_type.removeprefix("MOSTLY_").removeprefix("ALL_").lower().replace("f32", "fp32")
    assert count_params(c)["total"] == sum(int(t.n_elements) for t in reader.tensors)
    assert c.name == path.name


def test_a_folder_is_planned_from_its_config_json():
    folder = resolve("all-minilm-l6-v2")  # a BERT checkpoint folder with its pooler
    hf = json.loads((folder / "config.json").read_text())
    c = describe(folder).config
    assert (c.num_layers, c.d_model, c.num_heads, c.d_ff, c.vocab_size, c.max_positions) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["num_attention_heads"],
        hf["intermediate_size"],
        hf["vocab_size"],
        hf["max_position_embeddings"],
    )
    assert c.pooler and count_params(c)["total"] == safetensors_elements(folder)


def plan_cli(*argv: str):
    sub = argparse.ArgumentParser().add_subparsers()
    planning.add_cli(sub)
    args = sub.choices["plan"].parse_args(list(argv))
    return args.func(args)


def test_the_command_prices_a_file_as_stored(capsys):
    path = resolve("smollm2-135m-instruct")
    assert plan_cli(str(path), "--memory", "1GiB") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path.name}: llama, GQA 9q/3kv heads")
    assert "weights (q4_1+bf16)" in out and "weights priced as the file stores them (q4_1)" in out
    assert plan_cli(str(path), "--weights", "fp32") == 0  # --weights still wins
    assert "weights (fp32)" in capsys.readouterr().out
    assert plan_cli(str(FAMILIES / "qwen3")) == 0  # a folder
    assert capsys.readouterr().out.startswith("qwen3: llama, GQA 4q/2kv heads")


@pytest.mark.parametrize(
    "what, expect",
    [
        ("no-such-model", "not a preset, file or folder: 'no-such-model'; presets: bert-base, gpt2"),
        ("config.json", "is a file but not a .gguf"),
        ("empty", "has no config.json"),
    ],
)
def test_what_is_not_a_model_is_one_line(capsys, tmp_path, what, expect):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    target = what if what == "no-such-model" else str(tmp_path / what)
    assert plan_cli(target) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("headwise plan: error: ") and expect in line, line


def test_a_folder_whose_config_names_no_family_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    assert plan_cli(str(tmp_path)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown architecture: model_type='mamba'" in line, line
