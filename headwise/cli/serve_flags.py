"""`headwise serve MODEL ... --weights W --kv-dtype D --max-model-len N --max-num-seqs N
--served-model-name NAME[,NAME...]`: per-model settings without a TOML, named as vLLM names them.

Each flag is a key of a --config file's [models.NAME] table, and applies to every model served from
MODEL arguments (or, with none, to the two builtin models):

    --weights FORMAT           weights = FORMAT          auto (a GGUF as stored), fp32, bf16, int8, q4_k_m, ...
    --kv-dtype auto|int8|...   cache = "paged" | "int8"  the engine's KV pool (vLLM: --kv-cache-dtype);
                               | "bfloat16" | ...        bfloat16, float16, float32 store K/V as named
    --max-model-len N          max_model_len = N         prompt + output tokens a request may hold (2k = 2000, 2K = 2048)
    --max-num-seqs N           max_num_seqs = N          sequences running at once
    --served-model-name NAMES  [models.NAME]             the name clients send (comma-separated list)

--served-model-name: with one MODEL, as vLLM takes it: the model answers to every name, the first
is its own and the others are aliases (routes to it, listed in /v1/models). With several MODELs,
one name per MODEL, in order (`headwise serve a.gguf b/ --served-model-name chat,embed`). Given with
--config, any of them is an error naming the key to set in the file instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from .argtypes import positive_int, weights_name

# --kv-dtype -> LocalModel.cache: "auto" keeps the engine's own choice (16-bit K/V for a model with
# quantized weights, the model's dtype otherwise: runtime/config.py kv_dtype_for); "int8" ~1/4 of fp32
KV_DTYPES = {"auto": "paged", "int8": "int8", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

# flag -> (Namespace attribute, what says the same in a --config file)
FLAGS = {
    "--weights": ("weights", "weights = {v!r}"),
    "--kv-dtype": ("kv_dtype", "cache = {v!r}"),
    "--max-model-len": ("max_model_len", "max_model_len = {v}"),
    "--max-num-seqs": ("max_num_seqs", "max_num_seqs = {v}"),
    "--served-model-name": ("served_model_name", "the table's NAME, [models.{v[0]}]"),
}


def kv_dtype(text: str) -> str:
    """--kv-dtype: auto | int8 | bfloat16 | float16 | float32 -> the served model's `cache` (auto: paged)."""
    key = text.strip().lower()
    if key not in KV_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a KV dtype of headwise's engine; choose auto (16-bit K/V for quantized "
            "weights, the model's dtype otherwise), int8, bfloat16, float16 or float32"
        )
    return KV_DTYPES[key]


def token_count(text: str) -> int:
    """--max-model-len as vLLM reads it: 4096, 4k (4000), 4K (4096), 25.6k (25600); >= 1."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if m:
        number, unit = float(m.group(1)), m.group(2)
        scale = 1000 ** ("kmg".index(unit) + 1) if unit.islower() else 1024 ** ("KMG".index(unit) + 1) if unit else 1
        value = number * scale
        if value == int(value) and value >= 1:
            return int(value)
    raise argparse.ArgumentTypeError(
        f"must be a whole number of tokens >= 1, e.g. 4096, 4k (4000) or 4K (4096), got {text!r}"
    )


def model_names(text: str) -> list[str]:
    """--served-model-name a,b -> ["a", "b"]: non-empty, no spaces or control characters, no repeats."""
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if not n or any(c.isspace() or not c.isprintable() for c in n):
            raise argparse.ArgumentTypeError(
                f"{text!r} holds an empty name or one with spaces; give names separated by commas, e.g. chat,embed"
            )
    repeats = sorted({n for n in names if names.count(n) > 1})
    if repeats:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(repeats)} twice; each name once")
    return names


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The per-model flags, as a group of `parser` (the `headwise serve` subparser)."""
    g = parser.add_argument_group(
        "per-model settings",
        "for the MODEL arguments (with none, the builtin models); in a --config, keys of [models.NAME]",
    )
    g.add_argument(
        "--weights",
        type=weights_name,
        metavar="FORMAT",
        help="compute with the weights in FORMAT: auto (a GGUF as stored, else the checkpoint's dtype), fp32, bf16, "
        "int8, int4, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, or a mix q4_k_m, ...; [models.NAME] weights",
    )
    g.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        type=kv_dtype,
        metavar="auto|int8|bfloat16|float16|float32",
        help="the KV pool's dtype: auto (16-bit K/V for quantized weights, the model's dtype otherwise), int8 "
        "(about a quarter of fp32's bytes), bfloat16, float16 or float32; [models.NAME] cache = 'paged' (auto) "
        "or the dtype",
    )
    g.add_argument(
        "--max-model-len",
        type=token_count,
        metavar="N",
        help="most tokens (prompt + output) one request may hold, below the model's own context: 4096, 4k "
        "(4000) or 4K (4096); a longer request is a 400 context_length_exceeded; [models.NAME] max_model_len",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        metavar="N",
        help="sequences the engine runs at once (default 64); more wait in its queue; [models.NAME] max_num_seqs",
    )
    g.add_argument(
        "--served-model-name",
        type=model_names,
        metavar="NAME[,NAME...]",
        help='the name clients send as "model": with one MODEL, its name and then aliases (as vLLM takes '
        "several); with several MODELs, one name each, in order (default: the builtin's or the file's name)",
    )


def apply_model_flags(config, args: argparse.Namespace):
    """`config` (a ServeConfig from MODEL arguments or the defaults) with the per-model flags in `args`
    applied to each of its local models; raises ConfigError (one line) for a flag given with --config
    or names that do not fit the models."""
    from ..serve.config import ConfigError, Route, Target

    given = {flag: getattr(args, dest, None) for flag, (dest, _) in FLAGS.items()}
    given = {flag: v for flag, v in given.items() if v is not None}
    if not given:
        return config
    if getattr(args, "config", None):
        keys = "; ".join(FLAGS[f][1].format(v=v) for f, v in given.items())
        many = len(given) > 1
        raise ConfigError(
            f"{', '.join(given)} appl{'y' if many else 'ies'} to MODEL arguments, not to --config "
            f"{args.config}: set {'them' if many else 'it'} in each model's [models.NAME] table instead ({keys})"
        )
    models = list(config.models.values())
    names = given.get("--served-model-name")
    aliases: list[str] = []
    if names is not None:
        if len(models) == 1:
            names, aliases = names[:1], names[1:]  # vLLM: one model, several names it answers to
        elif len(names) != len(models):
            raise ConfigError(
                f"--served-model-name gives {len(names)} name(s) ({', '.join(names)}) for {len(models)} models "
                f"({', '.join(m.name for m in models)}): give one per model, in order, comma-separated; "
                "aliases of one model need it served alone, or [routes.NAME] in a --config"
            )
    out = {}
    for i, m in enumerate(models):
        changes: dict = {}
        if names is not None:
            changes["name"] = names[i]
        if "--weights" in given:
            changes["weights"] = given["--weights"]
        if "--kv-dtype" in given:
            changes["cache"] = given["--kv-dtype"]
        if "--max-model-len" in given:
            changes["max_model_len"] = given["--max-model-len"]
        if "--max-num-seqs" in given:
            n = given["--max-num-seqs"]  # a step decodes a token of each: the step budget grows to hold them
            steps = max(m.engine.max_num_batched_tokens, n)
            changes["engine"] = m.engine.replace(max_num_seqs=n, max_num_batched_tokens=steps)
        model = dataclasses.replace(m, **changes)
        out[model.name] = model
    routes = dict(config.routes)
    for alias in aliases:
        routes[alias] = Route(alias, (Target(names[0]),), retries=0)
    return dataclasses.replace(config, models=out, routes=routes)
