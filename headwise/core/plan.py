"""Parameters, FLOPs, KV-cache bytes and what fits in memory, for a ModelConfig.

Everything is counted exactly from the config, layer by layer; no torch. The CLI (plan_report.py)
is `headwise plan PRESET [--context N] [--batch B] [--dtype bf16] [--memory 80GiB]`
and `headwise plan all`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .config import AttentionConfig, ModelConfig
from .formats import MIXES, QUANT_FORMATS, big_gqa, fused_format, mix_format, target_format

DTYPE_BYTES = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "int8": 1,
    "fp8": 1, "float8": 1,  # e4m3 / e5m2; scales of quantized formats are not counted
}  # fmt: skip


def weight_bytes(cfg: ModelConfig, params: dict[str, int], dtype: str, weights: str | None) -> dict[str, int]:
    """Bytes of the weights by format: all in `dtype`, or with weights= a quantized format (q4_1,
    q8_0, ...) or one of llama-quantize's mixes (q4_k_m, ...) for the matrices (attention, MLP,
    embeddings, lm_head) and `dtype` for norms and the rest, as headwise.load(..., weights=) keeps
    them. Learned position tables stay in dtype."""
    if weights is None or weights.strip().lower() in DTYPE_BYTES:
        fmt = dtype if weights is None else weights.strip().lower()
        return {fmt: params["total"] * dtype_bytes(fmt)}
    fmt = weights.strip().lower()
    if fmt not in QUANT_FORMATS and fmt not in MIXES:
        valid = ", ".join([*DTYPE_BYTES, *QUANT_FORMATS, *MIXES])
        raise ValueError(f"unknown weights {weights!r}; valid: {valid}")
    out: dict[str, int] = {}
    floats = params["total"]
    matrices = _matrices(cfg, params)
    big = big_gqa(cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    formats = [
        mix_format(fmt, role, layer, cfg.num_layers, width, big_gqa=big)
        if fmt in MIXES  # the format llama-quantize's mix gives this matrix, as at load
        else target_format(fmt, width)  # a K-quant's fallback where rows are not whole blocks, as at load
        for role, layer, width, _ in matrices
    ]
    for i in range(0, len(matrices) - 2):  # a layer's q|k|v, fused at load where their formats can meet
        if [m[0] for m in matrices[i : i + 3]] == ["attn_q", "attn_k", "attn_v"] and None not in formats[i : i + 3]:
            formats[i : i + 3] = [fused_format(formats[i : i + 3]) or f for f in formats[i : i + 3]]
    for (role, layer, width, count), f in zip(matrices, formats):
        if f is None or not count:
            continue
        _, values, nbytes = QUANT_FORMATS[f]
        out[f] = out.get(f, 0) + -(-count // values) * nbytes
        floats -= count
    out[dtype] = out.get(dtype, 0) + floats * dtype_bytes(dtype)
    return out


def _matrices(cfg: ModelConfig, params: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """The quantizable matrices (attention, MLP, token embeddings, lm_head) as (role, layer, width of
    their rows, weights): roles as formats.ROLES; a block format needs whole blocks of the width."""
    C, L, F = cfg.d_model, cfg.num_layers, cfg.d_ff
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    positions = cfg.max_positions * C if cfg.positions == "learned" else 0
    up = [("ffn_gate", F * C), ("ffn_up", F * C)] if cfg.mlp == "swiglu" else [("ffn_up", F * C)]
    out = []
    for i in range(L):
        qkv = [("attn_q", C * HD), ("attn_k", C * KD), ("attn_v", C * KD)]
        if cfg.arch == "gpt2":  # its checkpoints fuse q|k|v (c_attn): llama.cpp's attn_qkv
            qkv = [("attn_qkv", C * (HD + 2 * KD))]
        out += [(role, i, C, n) for role, n in (*qkv, *up)]
        out += [("attn_output", i, HD, HD * C), ("ffn_down", i, F, F * C)]
    table = params["embeddings"] - positions
    if params["lm_head"]:  # a head of its own: the table is token_embd
        out += [("token_embd", 0, C, table), ("output", 0, C, params["lm_head"])]
    else:  # tied, or no head (an encoder): llama-quantize gives the table the output's type
        out.append(("output", 0, C, table))
    return out


def dtype_bytes(dtype: str) -> int:
    key = dtype.strip().lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str | int) -> int:
    """'80GiB' -> 80 * 2**30, '80GB' -> 80 * 10**9, '24G' -> 24 * 2**30, '512MiB', '1e9'.

    A bare K/M/G/T means the binary unit, as in `docker --memory 24g`.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", str(text).lower())
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"cannot read size {text!r}; write e.g. 80GiB, 80GB, 24G or 512MiB")
    number, prefix, binary, byte = m.groups()
    decimal = prefix and byte and not binary  # "GB" is 10**9; "GiB" and "G" are 2**30
    scale = 10 ** (3 * "kmgt".index(prefix) + 3) if decimal else _UNITS[prefix]
    return round(float(number) * scale)


# --- parameters --------------------------------------------------------------


def attention_params(attn: AttentionConfig) -> int:
    """One attention layer: Q (C, H*D) + K, V (C, Hkv*D) each + O (H*D, C), plus biases.

    = 2*C*H*D + 2*C*Hkv*D; for MHA with D = C/H that is 4*C^2 (the seed's count).
    """
    C, H, Hkv, D = attn.d_model, attn.num_heads, attn.num_kv_heads, attn.head_dim
    weights = C * H * D + 2 * C * Hkv * D + H * D * C
    biases = H * D + 2 * Hkv * D + C if attn.bias else 0
    return weights + biases


def mlp_params(cfg: ModelConfig) -> int:
    """One MLP: GELU has up (C, F) and down (F, C); SwiGLU adds a gate (C, F)."""
    C, F = cfg.d_model, cfg.d_ff
    if cfg.mlp == "swiglu":
        return 3 * C * F + (2 * F + C if cfg.mlp_bias else 0)
    return 2 * C * F + (F + C if cfg.mlp_bias else 0)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count, by part.

    attention  L * attention_params (see there)
    mlp        L * mlp_params
    embeddings token (V, C) + learned positions (max_positions, C) + token types
    lm_head    (C, V) only when the head is untied; 0 when tied or absent
    norms      2 per layer (4 with Gemma's post_norms) + a final one (pre-norm) or one on
               the embeddings (post-norm, BERT); LayerNorm is 2*C, RMSNorm C; qk_norm adds
               a D-wide RMSNorm on q and one on k per layer
    other      BERT's pooler, (C, C) + C
    """
    C, L = cfg.d_model, cfg.num_layers
    norm = 2 * C if cfg.norm == "layernorm" else C
    positions = cfg.max_positions * C if cfg.positions == "learned" else 0
    out_bias = C * (int(cfg.out_bias) - int(cfg.attn_bias))  # Qwen2 biases Q, K, V but not O
    per_layer_norms = (4 if cfg.post_norms else 2) * norm + (2 * cfg.head_dim if cfg.qk_norm else 0)
    counts = {
        "attention": L * (attention_params(cfg.attention) + out_bias),
        "mlp": L * mlp_params(cfg),
        "embeddings": cfg.vocab_size * C + positions + cfg.type_vocab_size * C,
        "lm_head": cfg.vocab_size * C if cfg.lm_head and not cfg.tie_embeddings else 0,
        "norms": L * per_layer_norms + norm,
        "other": C * C + C if cfg.pooler else 0,
    }
    counts["total"] = sum(counts.values())
    return counts


# --- FLOPs and KV cache --------------------------------------------------------


def flops_per_token(cfg: ModelConfig, context: int) -> dict[str, int]:
    """Forward FLOPs for one token that attends to `context` keys; FLOPs = 2 * MACs.

    projections  2 * L * attention weights (Q, K, V, O)
    attention    2 * 2 * keys * H * D per layer (q.k scores, then weights @ v); keys = context,
                 or min(context, W) for a sliding-window layer
    mlp          2 * L * MLP weights
    lm_head      2 * C * V for models that end in a vocab projection

    No causal averaging: this is the cost of the token at position `context`
    (a decode step, or any token of a bidirectional encoder). The mean over a
    causal prefill of n tokens is the same with context = (n + 1) / 2.
    Embedding lookups, norms, softmax and activations are elementwise and left out.
    """
    C, L, F, V = cfg.d_model, cfg.num_layers, cfg.d_ff, cfg.vocab_size
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    projection_weights = 2 * C * H * D + 2 * C * Hkv * D  # Q and O, K and V; biases are adds, not MACs
    mlp_weights = (3 if cfg.mlp == "swiglu" else 2) * C * F
    counts = {
        "projections": 2 * L * projection_weights,
        "attention": sum(2 * 2 * (context if w is None else min(context, w)) * H * D for w in cfg.windows),
        "mlp": 2 * L * mlp_weights,
        "lm_head": 2 * C * V if cfg.lm_head else 0,
    }
    counts["total"] = sum(counts.values())
    return counts


def kv_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """K and V for one token in every layer: 2 * L * Hkv * D * bytes(dtype).

    Encoders (cfg.causal False) keep no cache at inference; this is what caching
    their K/V would take, and plan() says so.
    """
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


KV_SCALE_BYTES = 4  # int8 KV caches keep one fp32 scale per (token, head), for K and for V


def kv_pool_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """One token in an engine's KV block pool: kv_bytes_per_token, + the scales for "int8"."""
    int8 = dtype.strip().lower() == "int8"
    return kv_bytes_per_token(cfg, dtype) + int8 * 2 * cfg.num_layers * cfg.num_kv_heads * KV_SCALE_BYTES


def kv_pool_blocks(cfg: ModelConfig, memory: int | str, *, block_size: int = 16, dtype: str = "bf16") -> int:
    """Blocks of `block_size` tokens that `memory` bytes of KV pool hold (0 if not one). A block
    holds the layers of one group (kv_layer_groups: all layers, unless windows differ).
    The engine sizes its pool with this (headwise.engine.EngineConfig.memory_budget_bytes)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    g = kv_layer_groups(cfg)[0]
    return max(0, parse_size(memory)) * cfg.num_layers // (kv_pool_bytes_per_token(cfg, dtype) * g * block_size)


# --- KV per layer type (global layers, and sliding-window layers that keep only their window)


def kv_layer_types(cfg: ModelConfig) -> list[tuple[int | None, int]]:
    """[(window, number of layers)]: global layers (None) first, then each window, smallest first."""
    counts: dict[int | None, int] = {}
    for w in cfg.windows:
        counts[w] = counts.get(w, 0) + 1
    return sorted(counts.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


def kv_layer_groups(cfg: ModelConfig) -> tuple[int, list[tuple[int | None, int]]]:
    """(g, [(window, groups)]): an engine's pool keeps one block table per group of g layers of
    one window, g the gcd of the layers per window (cache/hybrid.py); Gemma 3 270M: 3, one
    global group and five of window 512. A model with one kind of layer: (L, [(its window, 1)])."""
    types = kv_layer_types(cfg)
    g = math.gcd(*(n for _, n in types))
    return g, [(w, n // g) for w, n in types]


def kv_bytes_at(cfg: ModelConfig, context: int, dtype: str = "bf16") -> int:
    """K and V one sequence of `context` tokens holds: a windowed layer keeps min(context, W)."""
    per_layer = kv_bytes_per_token(cfg, dtype) // cfg.num_layers
    return sum(n * per_layer * (context if w is None else min(context, w)) for w, n in kv_layer_types(cfg))


def kv_pool_blocks_per_sequence(cfg: ModelConfig, tokens: int, block_size: int, chunk: int) -> int:
    """Pool blocks one sequence of `tokens` takes at most (prefill chunks up to `chunk` tokens):
    each global group a block per block_size tokens, each windowed group its window and a chunk."""
    g, groups = kv_layer_groups(cfg)
    return sum(
        n * (-(-tokens // block_size) if w is None else -(-min(tokens, w - 1 + chunk) // block_size) + 1)
        for w, n in groups
    )


def _max_context(cfg: ModelConfig, budget: int, dtype: str) -> int:
    """The longest context whose K/V (kv_bytes_at) fit in `budget` bytes: past the windows a
    token costs only its global layers; with every layer windowed, a budget that holds the
    windows holds any context (then: max_positions, and a note says so)."""
    per_token = kv_bytes_per_token(cfg, dtype)
    if per_token == 0:
        return 0
    lo, hi = 0, budget // (per_token // cfg.num_layers) + 1  # every token costs >= one layer
    if kv_bytes_at(cfg, hi, dtype) <= budget:
        return max(hi, cfg.max_positions)
    while hi - lo > 1:  # kv_bytes_at(lo) <= budget < kv_bytes_at(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_bytes_at(cfg, mid, dtype) <= budget else (lo, mid)
    return lo


# --- the plan ----------------------------------------------------------------


@dataclass
class Plan:
    """What `cfg` costs at (context, batch, dtype), and what fits in `memory`.

    Memory model: weights (params * bytes) + reserve + KV cache
    (kv_bytes_per_token * context * batch). `reserve` is yours to set for
    activations, CUDA context and fragmentation; by default nothing is reserved.
    """

    config: ModelConfig
    context: int
    batch: int
    dtype: str
    params: dict[str, int]
    flops: dict[str, int]  # per token, at `context`
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int  # the whole cache for (batch, context); 0 for encoders; windowed layers hold their window
    kv_layer_types: list = field(default_factory=list)  # [(window or None, layers, bytes per token of them)]
    memory: int | None = None
    reserve: int = 0
    fits: bool | None = None  # weights + reserve + KV <= memory
    max_context: int | None = None  # for `batch`, memory-bound only
    max_batch: int | None = None  # for `context`
    kv_pool_blocks: int | None = None  # an engine's KV pool in what is left: blocks of `block_size` tokens
    block_size: int = 16
    weight_formats: dict[str, int] = field(default_factory=dict)  # bytes per format (weights=)
    notes: list[str] = field(default_factory=list)


def plan(
    cfg: ModelConfig,
    context: int | None = None,
    batch: int = 1,
    dtype: str = "bf16",
    memory: int | str | None = None,
    reserve: int | str = 0,
    block_size: int = 16,
    weights: str | None = None,
) -> Plan:
    """dtype: the KV cache's (and the weights', unless `weights` names their format: e.g. "q4_1"
    for a 4-bit GGUF computed as stored, "int8" / "fp32")."""
    context = cfg.max_positions if context is None else context
    if context <= 0 or batch <= 0:
        raise ValueError(f"context={context} and batch={batch} must be positive")
    params = count_params(cfg)
    formats = weight_bytes(cfg, params, dtype, weights)
    per_token = kv_bytes_per_token(cfg, dtype)
    at_context = kv_bytes_at(cfg, context, dtype)
    result = Plan(
        config=cfg,
        context=context,
        batch=batch,
        dtype=dtype,
        params=params,
        flops=flops_per_token(cfg, context),
        weight_bytes=sum(formats.values()),
        weight_formats=formats,
        kv_bytes_per_token=per_token,
        kv_bytes=at_context * batch if cfg.causal else 0,
        kv_layer_types=[(w, n, per_token // cfg.num_layers * n) for w, n in kv_layer_types(cfg)],
        memory=None if memory is None else parse_size(memory),
        reserve=parse_size(reserve),
        block_size=block_size,
    )
    notes = result.notes
    if not cfg.causal:
        notes.append(
            f"encoder: no KV cache at inference (caching K/V would take {fmt_bytes(per_token)}/token); "
            "context and batch are bounded by activations and max_positions instead"
        )
    if context > cfg.max_positions:
        how = "learned position table" if cfg.positions == "learned" else "trained context (RoPE)"
        notes.append(f"context {context} is past the {how} of {cfg.max_positions}")
    if result.memory is None:
        return result
    free = result.memory - result.weight_bytes - result.reserve
    result.fits = free >= result.kv_bytes
    if free < 0:
        result.max_context = result.max_batch = 0
        devices = -(-(result.weight_bytes + result.reserve) // max(result.memory, 1))  # ceil
        notes.append(
            f"weights alone ({fmt_bytes(result.weight_bytes)} in {'+'.join(formats)}) + reserve do not fit in "
            f"{fmt_bytes(result.memory)}: {fmt_bytes(-free)} short; shard over >= {devices} such devices "
            "or use a smaller --dtype"
        )
    elif cfg.causal:
        result.max_context = _max_context(cfg, free // batch, dtype)
        result.max_batch = free // at_context
        result.kv_pool_blocks = kv_pool_blocks(cfg, free, block_size=block_size, dtype=dtype)
        if result.max_context > cfg.max_positions:
            trained = cfg.max_positions
            notes.append(f"memory allows context {result.max_context:,} but the model was trained on {trained:,}")
    return result


# --- formatting ----------------------------------------------------------------


def _short(value: float, units: list[str], step: float) -> str:
    i = 0
    while abs(value) >= step and i < len(units) - 1:
        value, i = value / step, i + 1
    digits = 0 if value == int(value) else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f}{units[i]}"


def fmt_count(n: float) -> str:
    """124439808 -> '124.44M', 6738415616 -> '6.74B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def fmt_bytes(n: float) -> str:
    """524288 -> '512 KiB', 1.5 * 2**30 -> '1.50 GiB', 137952391168 -> '128.5 GiB'."""
    return _short(n, [" B", " KiB", " MiB", " GiB", " TiB", " PiB"], 1024)


def fmt_flops(n: float) -> str:
    return _short(n, [" ", " K", " M", " G", " T", " P"], 1000) + "FLOP"
