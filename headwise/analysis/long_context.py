"""Heads at long context: per-head statistics and role labels without any attention pattern.

    lc = long_context_stats(model, batch)      # every layer, from the fused forward's LSE
    lc.roles.labels(layer, head)               # the labels roles.py gives, same thresholds
    lc.means["sink_mass"][layer]               # (H,) mean over real query rows

`roles.py` scores heads from their (T, T) patterns; at 16k tokens those are ~290 GB for
SmolLM2. Here a hook on every attention layer (the slot hooks.py uses, emptied in
`finally`) hands q, k, the LSE of the fused forward and the layer's values to
`attention.backends.head_stats`, which sums each row's statistics over key tiles in O(T)
memory; each layer's rows are averaged at once (real query rows only, as roles.py does)
and dropped, so one layer's (B, H, T) rows are all that is ever held.

Role labels from the statistics, with roles.py's thresholds (`roles.HeadRoles`):
  previous / next / offset   mass at offset -1 / +1 / the strongest other offset in
                             -8..8: roles.py's definitions exactly
  local                      mass within +-3 beyond the strongest offset there (roles.py's)
  broad                      entropy / log(visible keys) (roles.py's)
  sink                       mass on the first `sinks` positions (default 4, StreamingLLM's
                             sink tokens). roles.py puts sinks on the first token and the
                             special tokens; at long context those are the first positions
  long_range                 roles.py's formula, with the sinks above
  induction                  not scored: it needs the repeated-random-token batch, not a text
With sinks=1 on a batch without special tokens the scores equal roles.py's (tested).
Beside the labels: entropy, max weight, mass within `local` (default 16) tokens, mean
attended distance, and the value-weighted norm shares (Kobayashi et al. 2020, as
attribution.py defines them): the most attended key's share of sum_j a_ij ||f(x_j)|| and
the sinks' share, set against their share of the weight.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from ..attention import MultiHeadAttention
from ..attention.backends.head_stats import LOCAL, MAX_OFFSET, SINKS, HeadStats, head_stats
from ..attention.spec import make_spec
from ..attention.step import PlainStep
from .capture import Batch, encode, forward, is_causal
from .hooks import attention_layers
from .roles import LOCAL_WINDOW, MIN_KEYS, HeadRoles

# Per-head means kept beside the role scores: name -> what it is (for the JSON and the report)
STATS = {
    "entropy": "entropy of the row, nats",
    "max_weight": "largest weight of the row",
    "sink_mass": "mass on the first `sinks` tokens",
    "local_mass": "mass within `local` tokens",
    "distance": "mean attended distance, tokens",
    "top_norm_share": "most attended token's share of sum_j a_ij ||f(x_j)||",
    "sink_norm_share": "sinks' share of sum_j a_ij ||f(x_j)||",
}


@torch.no_grad()
def key_norms(layer: MultiHeadAttention, v: Tensor) -> Tensor:
    """||f_h(x_j)|| = ||W_O^h v_j|| for every query head h and key j: v (B, Hkv, S, D) -> (B, H, S),
    attribution.value_norms' numbers without its (B, H, S, C) tensor: W_O^h = Q R (QR, Q
    orthonormal), so ||W_O^h v|| = ||R v|| with R only (D, D)."""
    B, Hkv, S, D = v.shape
    H = layer.num_heads
    kv_of = torch.arange(H) // (H // Hkv)
    w_o = layer.projection_weights()[3].float().view(layer.d_model, H, D)  # (C, H, D)
    out = torch.empty(B, H, S, device=v.device)
    for h in range(H):
        r = torch.linalg.qr(w_o[:, h], mode="r").R  # (D, D)
        out[:, h] = (v[:, int(kv_of[h])].float() @ r.T).norm(dim=-1)  # (B, S)
    return out


class _Means:
    """Per-head running sums and row counts of per-row values, layer by layer."""

    def __init__(self, heads_per_layer: Sequence[int]):
        self.hpl = list(heads_per_layer)
        self.sums: dict[str, list[Tensor]] = {}
        self.counts: dict[str, list[Tensor]] = {}

    def add(self, name: str, layer: int, values: Tensor, rows: Tensor) -> None:
        """values (B, H, T, ...) at rows (broadcastable, bool) -> sums over batch and rows."""
        rows = rows.expand_as(values)
        if name not in self.sums:
            extra = values.shape[3:]
            self.sums[name] = [torch.zeros(h, *extra, dtype=torch.float64) for h in self.hpl]
            self.counts[name] = [torch.zeros(h, *extra, dtype=torch.float64) for h in self.hpl]
        self.sums[name][layer] += torch.where(rows, values, 0).sum((0, 2)).double()
        self.counts[name][layer] += rows.sum((0, 2)).double()

    def mean(self, name: str) -> list[Tensor]:
        return [(s / c.clamp_min(1)).float() for s, c in zip(self.sums[name], self.counts[name])]


def add_rows(means: _Means, layer: int, st: HeadStats, valid: Tensor) -> None:
    """Average one layer's per-row statistics over its real query rows (valid (B, T)), with the
    row conditions roles.py uses for each score."""
    rows = valid[:, None, :]  # (B, 1, T)
    vis, ns = st.visible, st.visible - st.visible_sinks  # (B, H, T) keys, non-sink keys
    live = rows & (vis > 0)
    for name in ("entropy", "max_weight", "local_mass", "top_norm_share", "sink_norm_share"):
        if getattr(st, name) is not None:
            means.add(name, layer, getattr(st, name), live)
    means.add("sink_mass", layer, st.sink_mass, rows & (ns > 0))
    means.add("distance", layer, st.distance, rows & (vis > 1))
    means.add("broad", layer, st.entropy / vis.clamp_min(2).log(), rows & (vis >= MIN_KEYS))
    m = (1 - st.sink_mass).clamp_min(0)  # non-sink mass of a live row
    reach = (st.distance - st.sink_distance) / m.clamp_min(1e-9)
    uniform = st.spread / ns.clamp_min(1)
    means.add("long_range", layer, m * (reach / (2 * uniform.clamp_min(1e-9))).clamp(max=1.0), rows & (ns >= MIN_KEYS))
    K = (st.offsets.shape[-1] - 1) // 2
    means.add("offsets", layer, st.offsets, rows[..., None] & (st.offsets_visible > 0))
    band = st.offsets[..., K - LOCAL_WINDOW : K + LOCAL_WINDOW + 1]
    means.add("local", layer, band.sum(-1) - band.amax(-1), rows & (vis > 2))


class _StatsHook:
    """What sits in `MultiHeadAttention.hook` for one layer during `gathered`: asks the fused
    backend for the LSE, turns q, k, v into statistics, leaves the output as it is."""

    wants_lse = True

    def __init__(self, index: int, run: "_Run"):
        self.index, self.run = index, run

    def __call__(self, layer, q, k, v, out, lse, weights, kwargs) -> Tensor:
        if k is None:
            raise ValueError("long-context statistics need a forward without cache=; run the whole sequence at once")
        run = self.run
        if layer.kv_map is not None:  # uneven groups after pruning: what attend_heads gives the backend
            k, v = k.index_select(1, layer.kv_map), v.index_select(1, layer.kv_map)
        names = ("attn_mask", "key_padding_mask", "alibi_slopes", "window", "scale", "softcap")  # Gemma: all
        masks = {n: kwargs.get(n) for n in names}
        spec = make_spec(q, k, k, is_causal=kwargs.get("is_causal", False), **masks)
        st = head_stats(
            q,
            k,
            spec,
            lse=lse,
            key_norms=key_norms(layer, v),
            sinks=run.sinks,
            local=run.local,
            offsets=MAX_OFFSET,
            block_q=run.block_q,
            block_k=run.block_k,
        )
        add_rows(run.means, self.index, st, run.valid.to(q.device))
        if run.progress is not None:
            run.progress.update(1)
        return out


@dataclass
class _Run:
    means: _Means
    valid: Tensor
    sinks: int
    local: int
    block_q: int | None
    block_k: int | None
    progress: object = None


@contextlib.contextmanager
def gathered(model: nn.Module, run: _Run):
    """Statistics hooks on every attention layer for one `with`, removed whatever happens."""
    layers = attention_layers(model)
    busy = [i for i, layer in enumerate(layers) if layer.hook is not None]
    if busy:
        raise RuntimeError(f"attention layers {busy} already have a hook attached (nested analysis on one model)")
    try:
        for i, layer in enumerate(layers):
            layer.hook = _StatsHook(i, run)
        yield run
    finally:
        for layer in layers:
            layer.hook = None


@dataclass
class LongContext:
    """Per-head results: `roles` (roles.py's scores and labels) and `means` (STATS, (H,) per layer)."""

    roles: HeadRoles
    means: dict[str, list[Tensor]]

    def to_json(self) -> dict:
        return {
            "roles": self.roles.to_json(),
            "stats": {n: [[round(float(x), 5) for x in t] for t in self.means[n]] for n in self.means},
        }


@torch.no_grad()
def long_context_stats(
    model: nn.Module,
    batch: Batch,
    *,
    sinks: int = SINKS,
    local: int = LOCAL,
    block_q: int | None = None,
    block_k: int | None = None,
    progress=None,
) -> LongContext:
    """One forward over `batch` with every head's statistics gathered (see the module docstring)."""
    layers = attention_layers(model)
    means = _Means([m.num_heads for m in layers])
    run = _Run(means, batch.valid, sinks, local, block_q, block_k, progress)
    with torch.inference_mode(), gathered(model, run):
        _light_forward(model, batch)
    offs = means.mean("offsets")  # (H, 2K+1) per layer
    K = MAX_OFFSET
    scores = {"previous": [o[:, K - 1] for o in offs], "next": [o[:, K + 1] for o in offs]}
    other = [k for k in range(-K, K + 1) if abs(k) != 1]
    cols = torch.tensor([k + K for k in other])
    best, arg = zip(*[o[:, cols].max(dim=1) for o in offs])
    scores["offset"] = list(best)
    offset_k = [torch.tensor(other)[a] for a in arg]
    for name in ("local", "long_range", "broad"):
        scores[name] = means.mean(name)
    scores["sink"] = means.mean("sink_mass")
    roles = HeadRoles(scores, offset_k, means.mean("distance"))
    return LongContext(roles, {n: means.mean(n) for n in STATS})


def _light_forward(model: nn.Module, batch: Batch) -> None:
    """The forward without (B, T, V) logits for decoders (3.2 GB for SmolLM2 at 16k tokens):
    the step asks for each row's last real token only."""
    if not (is_causal(model) and "step" in model.forward.__code__.co_varnames):
        forward(model, batch)
        return
    device = next(model.parameters()).device
    B, T = batch.ids.shape
    lengths = batch.mask.sum(1)
    pad = None if bool(batch.mask.all()) else ~batch.valid.to(device)
    last = (torch.arange(B) * T + lengths - 1).to(device)
    model(batch.ids.to(device), PlainStep(B, T, device, key_padding_mask=pad, logits_indices=last))


def context_batch(model: nn.Module, paragraphs: Sequence[str], length: int) -> tuple[Batch, int]:
    """One row of exactly `length` tokens of running text: the paragraphs in order, the whole
    text repeated when it is shorter. Returns the batch and how many copies of the text it took."""
    check_context(model, length)
    if not paragraphs:
        raise ValueError("the corpus has no paragraphs to build a long context from")
    text, copies = "\n\n".join(paragraphs), 1
    tok = model.tokenizer
    n = len(tok.encode(text))
    while n < length:  # tokens of a repeated text grow linearly; one more copy at a time is cheap
        copies = math.ceil(length / max(n // copies, 1))
        text = "\n\n".join(["\n\n".join(paragraphs)] * copies)
        n = len(tok.encode(text))
    return encode(model, text, max_length=length), copies


def check_context(model: nn.Module, length: int) -> None:
    """A model with a learned position table cannot read past it (RoPE models can, untrained)."""
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "max_positions", None)
    if getattr(cfg, "positions", "rope") == "learned" and limit is not None and length > limit:
        raise ValueError(
            f"--context {length} is longer than the {limit} positions this model learned "
            f"(a position table, not RoPE); pass --context {limit} or less"
        )
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"{type(model).__name__} has no tokenizer to turn the corpus into {length} tokens")


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    except (OSError, StopIteration):
        return None


def reset_peak() -> bool:
    """Peak RSS := current RSS (Linux: /proc/self/clear_refs), so VmHWM then measures one step."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def study(
    model: nn.Module,
    paragraphs: Sequence[str],
    length: int,
    *,
    source: str = "",
    sinks: int = SINKS,
    local: int = LOCAL,
    progress=None,
) -> dict:
    """The long-context step of `headwise analyze --context N`: statistics of every head over
    `length` tokens, with the wall time and the peak memory of the pass."""
    batch, copies = context_batch(model, paragraphs, length)
    T = batch.ids.shape[1]
    hpl = [m.num_heads for m in attention_layers(model)]
    reset = reset_peak()
    before = _status_bytes("VmRSS:")
    t0 = time.perf_counter()
    lc = long_context_stats(model, batch, sinks=sinks, local=local, progress=progress)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM:")
    cfg = getattr(model, "config", None)
    trained = getattr(cfg, "max_positions", None)
    memory = {
        "method": "VmHWM, the process's peak resident set (Linux), reset through /proc/self/clear_refs "
        "before the pass" + ("" if reset else " (reset failed: the peak of the whole process)"),
        "rss_before_mib": round(before / 2**20, 1) if before else None,
        "peak_mib": round(peak / 2**20, 1) if peak else None,
        "extra_mib": round((peak - before) / 2**20, 1) if peak and before else None,
    }
    return {
        "tokens": T,
        "source": source,
        "copies": copies,
        "sinks": sinks,
        "local": local,
        "trained_context": trained,
        "beyond_trained_context": bool(trained and T > trained),
        "seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "memory": memory,
        "patterns_bytes": sum(h * T * T * 4 for h in hpl),  # what the (T, T) fp32 patterns would take
        **lc.to_json(),
    }


def summary_lines(lc: dict) -> list[str]:
    """What `headwise analyze` prints about the long-context step."""
    from .roles import ROLES

    mem = lc["memory"]
    counts = {r: 0 for r in ROLES}
    for row in lc["roles"]["heads"]:
        for info in row:
            for lab in info["labels"]:
                counts["offset" if lab.startswith("offset") else lab] += 1
    labels = ", ".join(f"{r} {n}" for r, n in counts.items() if n)
    note = f" (beyond the trained {lc['trained_context']})" if lc["beyond_trained_context"] else ""
    return [
        f"long context: {lc['tokens']} tokens{note} in {lc['seconds']:.0f} s; peak memory {mem['peak_mib']} MiB, "
        f"{mem['extra_mib']} MiB above the {mem['rss_before_mib']} MiB before ({mem['method']}); the (T, T) "
        f"patterns would take {lc['patterns_bytes'] / 2**30:.1f} GiB",
        f"long-context role labels: {labels or 'none'}",
    ]
