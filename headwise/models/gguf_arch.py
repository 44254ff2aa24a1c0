"""Per-architecture GGUF tables: llama.cpp's metadata -> an HF config dict, its tensor names -> HF names.

One `Arch` per `general.architecture` that headwise reads, as llama.cpp keeps one hparams loader
and one tensor list per architecture (src/models/<arch>.cpp; gguf-py's tensor_mapping.py, read
backwards). Each says how to undo what convert_hf_to_gguf.py did to the tensors:

- permute_qk: Llama-arch Q/K rows interleaved for GPT-J-style RoPE (LlamaModel.permute); only
  the "llama" architecture (Mistral too: the converter writes it as llama). Qwen, Phi-3 and Gemma
  are written in HF's (NeoX) order.
- norm_shift: Gemma's RMSNorm computes x * (1 + w); the converter stores 1 + w for every tensor
  whose HF name ends in "norm.weight" (all norms, q/k norms included). HF's w is that minus 1.
- transposed: GPT-2's Conv1D weights are (in, out) in HF; the converter stores them as (out, in).

The values llama.cpp assumes when a key is absent are the defaults here, so a file means what it
means to llama.cpp: e.g. Gemma 3's every-6th-layer-global pattern, its local RoPE base 10000, and
its attention scale 1/sqrt(key_length) (n_embd/n_head for the 62-layer 27B) as query_pre_attn_scalar.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from .gguf_meta import GGUFError

# llama.cpp's per-layer tensors of a RoPE decoder -> HF names under model.layers.{i}.
_DECODER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_DECODER_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Phi-3 keeps HF's fused matrices: attn_qkv = qkv_proj rows [Q | K | V], ffn_up = gate_up_proj rows [gate | up]
_PHI3 = {**_DECODER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2/3: a norm before and after attention and the MLP; llama.cpp's ffn_norm is the one before
_GEMMA = {
    **_DECODER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2 = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GPT2_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_BERT = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
_BERT_GLOBAL = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}


def f32(x) -> float:
    """GGUF stores floats as f32: 1e-5 arrives as 9.99999974e-06. Give back the short decimal it came from."""
    return float(str(np.float32(x)))


class Meta:
    """`general.architecture`'s keys of one file: m("embedding_length") reads "<arch>.embedding_length"."""

    def __init__(self, meta: dict, path, names: set[str], shapes: dict[str, tuple[int, ...]]):
        self.meta, self.path, self.names, self.shapes = meta, path, names, shapes
        self.arch = meta["general.architecture"]

    def __call__(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        if f"{self.arch}.{key}" not in self.meta:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return self.meta[f"{self.arch}.{key}"]

    def rows(self, tensor: str) -> int:
        """A 2-D tensor's HF row count (ggml lists the fastest dim first)."""
        return self.shapes[tensor][0]


# The keys sizes are read from. Each must be a positive int where present: the config divides by
# the head count (0 was a ZeroDivisionError), and every module is sized from these before a tensor is.
_SIZES = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "context_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
)


def check_sizes(m: Meta) -> None:
    """Refuse sizes no model has (0 heads, a float, a per-layer array) before anything divides by
    them or is sized from them."""
    for key in _SIZES:
        value = m(key)
        if isinstance(value, list):
            raise GGUFError(f"{m.path}: metadata {m.arch}.{key} is a per-layer array, which headwise does not read")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise GGUFError(f"{m.path}: metadata {m.arch}.{key}={value!r} must be a positive integer")


def check_layers(meta: dict, names: list[str], path) -> None:
    """Refuse a block_count other than the layers whose tensors the file holds (as llama.cpp's loader
    does), before the model is sized from it: a block_count of 4e9 would otherwise build 4e9 layers'
    worth of config and modules before a missing tensor is noticed."""
    arch = meta.get("general.architecture")
    n = meta.get(f"{arch}.block_count")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return  # check_sizes names it
    parts = [name.split(".") for name in names]
    layers = sorted({int(p[1]) for p in parts if p[0] == "blk" and len(p) > 1 and p[1].isascii() and p[1].isdigit()})
    if len(layers) != n or layers[-1] != n - 1:
        found = f"{len(layers)} layers (blk.{layers[0]} .. blk.{layers[-1]})" if layers else "no layers"
        raise GGUFError(
            f"{path}: metadata {arch}.block_count={n}, but the file's tensors are for {found}; "
            "the file is corrupt or its metadata was edited"
        )


def _decoder(m: Meta, model_type: str, architecture: str, act: str = "silu") -> dict:
    """The HF fields every RoPE decoder has (Llama's names)."""
    C, H = m.need("embedding_length"), m.need("attention.head_count")
    D = m("attention.key_length", C // H)
    if m("rope.dimension_count", D) != D and model_type != "phi3":
        raise GGUFError(f"{m.path}: rope.dimension_count={m('rope.dimension_count')} != head_dim={D} (partial rotary)")
    if "rope_freqs.weight" in m.names or "rope_factors_long.weight" in m.names:
        raise GGUFError(
            f"{m.path} has per-frequency RoPE factors (rope_freqs / rope_factors_long: Llama 3.1 or "
            "Phi-3 longrope), which headwise does not apply yet"
        )
    scaling = None
    kind = m("rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": f32(m("rope.scaling.factor", 1.0))}
        if m("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = m("rope.scaling.original_context_length")
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": C,
        "intermediate_size": m.need("feed_forward_length"),
        "num_hidden_layers": m.need("block_count"),
        "num_attention_heads": H,
        "num_key_value_heads": m("attention.head_count_kv", H),  # absent means MHA
        "head_dim": D,
        "hidden_act": act,
        "rms_norm_eps": f32(m.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(m("rope.freq_base", 10000.0)),  # llama.cpp's default
        "rope_scaling": scaling,
        "max_position_embeddings": m.need("context_length"),
        "vocab_size": m.rows("token_embd.weight"),
        "tie_word_embeddings": "output.weight" not in m.names,  # llama.cpp reuses token_embd then
        "attention_bias": "blk.0.attn_q.bias" in m.names,
        "mlp_bias": False,
        **_token_ids(m.meta),
    }


def _token_ids(meta: dict) -> dict:
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _llama(m: Meta) -> dict:
    return _decoder(m, "llama", "LlamaForCausalLM")


def _qwen2(m: Meta) -> dict:
    return _decoder(m, "qwen2", "Qwen2ForCausalLM") | {"use_sliding_window": False}


def _qwen3(m: Meta) -> dict:
    return _decoder(m, "qwen3", "Qwen3ForCausalLM") | {"use_sliding_window": False}


def _phi3(m: Meta) -> dict:
    cfg = _decoder(m, "phi3", "Phi3ForCausalLM")
    rot = m("rope.dimension_count", cfg["head_dim"])
    # the converter writes 0 for "none" (Phi-4). llama.cpp 11434 reads a window and runs without it
    # ("Phi SWA is currently disabled"); the checkpoint (and transformers) has it, so we keep it
    window = m("attention.sliding_window", 0)
    return cfg | {
        "partial_rotary_factor": rot / cfg["head_dim"],
        "sliding_window": window or None,
        "original_max_position_embeddings": m("rope.scaling.original_context_length", cfg["max_position_embeddings"]),
        "rope_scaling": None,  # original_context_length alone is not scaling (longrope is refused above)
    }


def _layer_types(m: Meta, every: int) -> list[str]:
    """llama.cpp's load_swa_pattern: an array of per-layer flags, or n (layer il is local when
    il % n < n - 1), else the architecture's n; "full_attention" / "sliding_attention" as HF names them."""
    n_layers, pattern = m.need("block_count"), m("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise GGUFError(
                f"{m.path}: metadata {m.arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                f"for {n_layers} layers"
            )
        local = [bool(x) for x in pattern]
    else:
        local = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in local]


def _gemma_scalar(m: Meta, cfg: dict, big_layers: int) -> int:
    """llama.cpp scales queries by 1/sqrt(key_length), or by 1/sqrt(n_embd/n_head) on the 27B."""
    return (
        cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == big_layers else cfg["head_dim"]
    )


def _gemma2(m: Meta) -> dict:
    cfg = _decoder(m, "gemma2", "Gemma2ForCausalLM")
    cfg.pop("hidden_act")
    soft = m("attn_logit_softcapping")
    final = m("final_logit_softcapping")
    return cfg | {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(m, cfg, 46),
        "attn_logit_softcapping": f32(soft) if soft else None,
        "final_logit_softcapping": f32(final) if final else None,
        "sliding_window": m("attention.sliding_window", 4096),  # llama.cpp's Gemma 2 default
        "layer_types": _layer_types(m, 2),
    }


def _gemma3(m: Meta) -> dict:
    cfg = _decoder(m, "gemma3_text", "Gemma3ForCausalLM")
    cfg.pop("hidden_act")
    window = m("attention.sliding_window", 0)
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if cfg["rope_scaling"]:
        full |= cfg["rope_scaling"]  # llama.cpp scales the global layers' RoPE only
    cfg.pop("rope_scaling")
    final = m("final_logit_softcapping")
    n = cfg["num_hidden_layers"]
    return cfg | {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(m, cfg, 62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": f32(final) if final else None,
        "sliding_window": window or None,
        "layer_types": _layer_types(m, 6) if window else ["full_attention"] * n,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": f32(m("rope.freq_base_swa", 10000.0))},
        },
    }


def _gpt2(m: Meta) -> dict:
    C = m.need("embedding_length")
    ff = m("feed_forward_length", 4 * C)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": C,
        "n_layer": m.need("block_count"),
        "n_head": m.need("attention.head_count"),
        "n_inner": None if ff == 4 * C else ff,
        "n_positions": m.need("context_length"),
        "layer_norm_epsilon": f32(m.need("attention.layer_norm_epsilon")),
        "activation_function": "gelu_new",  # llama.cpp's GPT-2 graph: tanh GELU
        "vocab_size": m.rows("token_embd.weight"),
        "tie_word_embeddings": True,
        **_token_ids(m.meta),
    }


def _bert(m: Meta) -> dict:
    if m("pooling_type") not in (None, 0, 1, 2):  # none, mean, cls: what the encoder outputs do not change
        raise GGUFError(f"{m.path}: bert.pooling_type={m('pooling_type')} is not supported")
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": m.need("embedding_length"),
        "num_hidden_layers": m.need("block_count"),
        "num_attention_heads": m.need("attention.head_count"),
        "intermediate_size": m.need("feed_forward_length"),
        "max_position_embeddings": m.need("context_length"),
        "type_vocab_size": m.rows("token_types.weight") if "token_types.weight" in m.names else 0,
        "layer_norm_eps": f32(m.need("attention.layer_norm_epsilon")),
        "hidden_act": "gelu",
        "vocab_size": m.rows("token_embd.weight"),
        "pad_token_id": m.meta.get("tokenizer.ggml.padding_token_id"),
    }


class Arch(NamedTuple):
    config: Callable[[Meta], dict]  # metadata -> HF config dict
    block: dict[str, str]  # blk.{i}.<key>.{weight|bias} -> <layer prefix><value>.{weight|bias}
    globals: dict[str, str]  # <key>.{weight|bias} -> <value>.{weight|bias}
    layer_prefix: str = "model.layers.{i}."
    permute_qk: bool = False
    norm_shift: float = 0.0
    transposed: bool = False  # 2-D block weights stored (out, in) that HF keeps (in, out)


ARCHS = {
    "llama": Arch(_llama, _DECODER, _DECODER_GLOBAL, permute_qk=True),
    "qwen2": Arch(_qwen2, _DECODER, _DECODER_GLOBAL),
    "qwen3": Arch(_qwen3, _DECODER, _DECODER_GLOBAL),
    "phi3": Arch(_phi3, _PHI3, _DECODER_GLOBAL),
    "gemma2": Arch(_gemma2, _GEMMA, _DECODER_GLOBAL, norm_shift=1.0),
    "gemma3": Arch(_gemma3, _GEMMA, _DECODER_GLOBAL, norm_shift=1.0),
    "gpt2": Arch(_gpt2, _GPT2, _GPT2_GLOBAL, layer_prefix="transformer.h.{i}.", transposed=True),
    "bert": Arch(_bert, _BERT, _BERT_GLOBAL, layer_prefix="encoder.layer.{i}."),
}


def hf_name(arch: Arch, name: str) -> str | None:
    """llama.cpp's tensor name -> the HF name, or None when the table has none."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in arch.globals:
        return f"{arch.globals[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.block:
        return arch.layer_prefix.format(i=parts[1]) + f"{arch.block[parts[2]]}.{parts[3]}"
    return None


def expected_shape(hf: str, cfg: dict) -> tuple[int, ...] | None:
    """A RoPE decoder's tensor shape as its HF config implies (None: not checked here; loading.convert
    checks every family's shapes against its table, by HF name)."""
    if "hidden_size" not in cfg or "num_key_value_heads" not in cfg:
        return None  # GPT-2, BERT
    C, I, V, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    kind = hf.rsplit(".", 2)[-2] if hf.startswith("model.layers.") else hf.removesuffix(".weight")
    shape = {
        "model.embed_tokens": (V, C),
        "lm_head": (V, C),
        "q_proj": (q, C),
        "k_proj": (kv, C),
        "v_proj": (kv, C),
        "qkv_proj": (q + 2 * kv, C),
        "o_proj": (C, q),
        "gate_proj": (I, C),
        "up_proj": (I, C),
        "gate_up_proj": (2 * I, C),
        "down_proj": (C, I),
        "q_norm": (D,),
        "k_norm": (D,),
    }.get(kind, (C,))  # the rest are norms over C
    return shape[:1] if hf.endswith(".bias") else shape


def is_norm(name: str) -> bool:
    """A norm weight the Gemma converter shifted by 1 (its HF name ends in "norm.weight")."""
    return name.endswith("norm.weight")
