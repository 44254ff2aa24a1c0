"""Gemma 3 text (Gemma Team 2025, arXiv:2503.19786): Gemma 2's block (pre+post norms, GeGLU,
query_pre_attn_scalar, embeddings times sqrt(C)) with QK-norm (1 + w, as every Gemma norm) and
no soft-caps by default; five local sliding-window layers to one global (HF layer_types, else
sliding_window_pattern = 6); local layers rotate with rope_local_base_freq (10k, unscaled),
global ones with rope_theta (1M) and its scaling (linear 8 on the 4B+ models). MQA on 270M/1B.

model_type "gemma3_text" (Gemma3ForCausalLM) loads; "gemma3" (Gemma3ForConditionalGeneration)
loads its text_config and language-model weights, the vision tower and projector left unread."""

from __future__ import annotations

from ...core.config import ModelConfig
from ..loading import CheckpointError, To
from . import gemma2
from .decoder import Decoder
from .hf import FULL, SLIDING, rope_params

Model = Decoder
_PREFIXES = ("model.language_model.", "language_model.model.")  # transformers 5, then 4
_VISION = ("model.vision_tower.*", "model.multi_modal_projector.*", "vision_tower.*", "multi_modal_projector.*")


def hf_name(name: str) -> str:
    """A Gemma3ForConditionalGeneration's language-model tensor -> Gemma3ForCausalLM's name."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return "lm_head.weight" if name == "language_model.lm_head.weight" else name


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF Gemma3TextConfig dict (or a Gemma3Config's text_config) -> ModelConfig."""
    if hf.get("model_type") == "gemma3":
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError("gemma3 config has no text_config; give a Gemma3ForCausalLM (gemma3_text) checkpoint")
        hf = {"model_type": "gemma3_text", **hf["text_config"]}
    n = hf.get("num_hidden_layers", 0)
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    fields = gemma2.gemma_fields(hf, [SLIDING if (i + 1) % pattern else FULL for i in range(n)])
    rp = hf.get("rope_parameters") or {}
    if SLIDING in rp:  # transformers 5: RoPE per layer type
        local_theta, scaling = rope_params(hf, fields["max_positions"], SLIDING)
        if scaling is not None:
            raise CheckpointError(f"gemma3: rope scaling {scaling.kind!r} on the sliding layers is not supported")
    else:  # transformers 4: its own key, 10k by default
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    if "rope_theta" not in hf and "rope_theta" not in rp.get(FULL, {}):
        fields["rope_theta"] = 1_000_000.0  # Gemma3TextConfig's default for the global layers
    return ModelConfig(**fields, qk_norm=True, rope_local_theta=local_theta)


# fmt: off
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """Gemma 2's table and each layer's qk-norm weights (D,), 1 + w as every Gemma norm."""
    hf, hw, D = "model.layers.{i}.self_attn.", "layers.{i}.attn.", cfg.head_dim
    return gemma2.weight_table(cfg) | {
        hf + "q_norm.weight":  To(hw + "q_norm.weight", (D,), add=1.0),
        hf + "k_norm.weight":  To(hw + "k_norm.weight", (D,), add=1.0),
    }
# fmt: on


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """Not weights of the text model: a tied head's copy, a multimodal checkpoint's vision parts."""
    return (*(("lm_head.weight",) if cfg.tie_embeddings else ()), *_VISION)
