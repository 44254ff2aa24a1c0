"""The whole head analysis of one model: what `headwise analyze MODEL` runs.

Steps (each with a progress bar), all numbers into one JSON-able dict:
  1. the text: patterns of every head, value-weighted norms, rollout (figures + HTML)
  2. roles of every head over the fit half of the corpus (+ repeated random tokens), and per
     layer type (local sliding-window layers vs global ones: layer_types.py)
  3. "hints, not explanations": weight vs norm share of each head's top token, same text
  4. importance (Michel et al. 2019) on the fit half
  5. ablation curves on the held-out half: importance / per-layer / mean ablation / random
  6. real pruning of the least important fraction: params, latency, quality, save + reload
  7. cause: activation patching and direct logit attribution per head on prompt pairs
  8. with `context`: every head's statistics over that many tokens, in O(T) memory (long_context.py)
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..core.examples import ANALYSIS_TEXT
from . import ablation, metrics, patching, prune
from .attribution import HintAccumulator, attribute
from .capture import Batch, forward, is_causal
from .corpus import Corpus
from .hooks import heads_per_layer
from .importance import head_importance
from .layer_types import by_layer_type, windows
from .roles import head_roles

DEFAULT_TEXT = ANALYSIS_TEXT  # core/examples.py: `headwise analyze --text`'s default too


@dataclass
class Settings:
    """How much of the corpus each step uses. Encoders count sentences, decoders count rows of
    `seq_len` tokens; None = the default for the model kind (sized for ~5 min on 2 cores)."""

    fit: int | None = None  # importance, mean ablation, roles
    heldout: int | None = None  # ablation curves and pruning quality
    seq_len: int = 128  # decoder rows
    batch_size: int | None = None
    seeds: int = 3  # random orders
    fractions: Sequence[float] = ablation.FRACTIONS
    prune: float = 0.3  # fraction of heads pruned for real; 0 = skip
    mean_ablation: bool = True
    per_layer: bool = True
    induction_len: int = 32
    latency_rounds: int = 10
    patching: bool = True  # activation patching + direct logit attribution (patching.study)
    pairs: Sequence | None = None  # patching.Pair list; None = pairs.default_pairs (skips ones that don't fit)
    context: int | None = None  # tokens of the long-context step (long_context.study); None = skip

    def resolved(self, causal: bool) -> "Settings":
        s = copy.copy(self)
        if causal:
            s.fit, s.heldout, s.batch_size = s.fit or 4, s.heldout or 4, s.batch_size or 4
        else:
            s.fit, s.heldout, s.batch_size = s.fit or 128, s.heldout or 192, s.batch_size or 32
        return s


@dataclass
class Progress:
    """tqdm bars when `show`, silent otherwise (tests)."""

    show: bool = True
    timings: dict = field(default_factory=dict)

    def step(self, name: str, total: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=name, disable=not self.show, leave=True, dynamic_ncols=True)


def _data(model: nn.Module, corpus: Corpus, s: Settings) -> tuple[list[Batch], list[Batch]]:
    if is_causal(model):
        fit = metrics.token_batches(
            model, corpus.fit_paragraphs, seq_len=s.seq_len, rows=s.fit, batch_size=s.batch_size
        )
        held = metrics.token_batches(
            model, corpus.heldout_paragraphs, seq_len=s.seq_len, rows=s.heldout, batch_size=s.batch_size
        )
        return fit, held
    fit_s, held_s = corpus.fit_sentences, corpus.heldout_sentences
    for name, have, want in (("fit", fit_s, s.fit), ("held-out", held_s, s.heldout)):
        if len(have) < want:
            raise ValueError(f"the corpus has {len(have)} {name} sentences; {want} were asked for")
    step = max(1, len(fit_s) // s.fit)  # spread the sample over the whole half
    fit = metrics.text_batches(model, fit_s[::step][: s.fit], batch_size=s.batch_size, max_length=128)
    step = max(1, len(held_s) // s.heldout)
    held = metrics.text_batches(model, held_s[::step][: s.heldout], batch_size=s.batch_size, max_length=128)
    return fit, held


def text_view(model: nn.Module, text: str) -> dict:
    """Everything the figures and the HTML page show for the text."""
    att = attribute(model, text)
    b = att["batch"]
    L = len(att["pattern"])
    return {
        "text": text,
        "tokens": b.tokens[0],
        "sinks": b.sinks[0].tolist(),
        "causal": is_causal(model),
        "pattern": [_rounded(att["pattern"][l][0]) for l in range(L)],  # L x H x T x T
        "norms": [_rounded(att["norms"][l][0]) for l in range(L)],
        "rollout": _rounded(att["rollout"][0]),
    }


def _rounded(t: torch.Tensor, digits: int = 4) -> list:
    return torch.round(t.float(), decimals=digits).tolist()


def latency(fns: dict[str, Callable[[], object]], rounds: int) -> dict:
    """Interleaved, rotated rounds after one warm-up each (benchmarks/_common.py's method):
    min / median / max seconds per contender, and the load average while it ran."""
    names = list(fns)
    for f in fns.values():
        f()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    out = {
        n: {"min": min(t), "median": statistics.median(t), "max": max(t), "rounds": rounds} for n, t in times.items()
    }
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    out["threads"] = torch.get_num_threads()
    return out


def prune_study(
    model: nn.Module,
    importance,
    metric,
    held: Sequence[Batch],
    fraction: float,
    out: Path,
    rounds: int,
    progress: Progress,
) -> dict:
    """Prune the least important `fraction` of heads (global order) for real; save, reload, measure."""
    hpl = heads_per_layer(model)
    removed = ablation.take(importance.order(), round(fraction * sum(hpl)), hpl)
    plan = prune.plan_from(removed, model)
    bar = progress.step("pruning", 4)
    masked = metric.evaluate(model, mask=ablation.masks_for(removed, hpl))
    small = prune.prune_heads(prune.clone(model), plan)
    bar.update(1)
    path = prune.save_pruned(small, out / "pruned")
    reloaded = prune.load_pruned(path)
    bench = held[len(held) // 2]  # a typical batch (encoder batches are length-sorted)
    if is_causal(model):
        bench = bench.slice(0, 1)  # decoders: one row of seq_len tokens (a prefill)
    with torch.no_grad():
        same = float((forward(small, bench) - forward(reloaded, bench)).abs().max())
    bar.update(1)
    after = metric.evaluate(reloaded)
    quality = {"metric": metric.name, "drop_unit": metric.unit, "before": metric.baseline, "after": after}
    prune.record_quality(path, quality | {"drop": metric.drop(after)})  # listed by `headwise serve`
    bar.update(1)
    with torch.inference_mode():
        lat = latency({"full": lambda: forward(model, bench), "pruned": lambda: forward(reloaded, bench)}, rounds)
    bar.update(1)
    bar.close()
    before = metric.baseline
    return {
        "fraction": fraction,
        "plan": {str(k): v for k, v in plan.items()},
        "heads_removed": len(removed),
        "layers_after": prune.head_counts(reloaded),
        "saved_to": str(path),
        "params_before": prune.param_count(model),
        "params_after": prune.param_count(reloaded),
        "quality_before": before,
        "quality_after": after,
        "quality_masked": masked,
        "drop_after": metric.drop(after),
        "reload_max_abs_diff": same,
        "latency_batch": list(bench.ids.shape),
        "latency": lat,
        "speedup_median": lat["full"]["median"] / lat["pruned"]["median"],
    }


def analyze(
    model: nn.Module,
    corpus: Corpus,
    *,
    text: str = DEFAULT_TEXT,
    out: str | Path = "analysis",
    settings: Settings | None = None,
    show_progress: bool = True,
    name: str | None = None,
) -> dict:
    """Run every step on `model` and write nothing but the pruned model (report.write does the rest)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    causal = is_causal(model)
    s = (settings or Settings()).resolved(causal)
    prog = Progress(show_progress)
    hpl = heads_per_layer(model)
    attn0 = model.config
    result = {
        "model": {
            "name": name or attn0.name,
            "arch": attn0.arch,
            "causal": causal,
            "layers": len(hpl),
            "heads": hpl,
            "kv_heads": attn0.num_kv_heads,
            "windows": windows(model),  # per layer: W keys (local) or None (global)
            "params": prune.param_count(model),
        },
        "corpus": {"source": corpus.source},
        "settings": asdict(s) | {"fractions": list(s.fractions)},
        "timings_s": {},
    }
    t = time.perf_counter()

    def lap(step):
        nonlocal t
        now = time.perf_counter()
        result["timings_s"][step] = round(now - t, 2)
        t = now

    fit, held = _data(model, corpus, s)
    result["corpus"] |= {
        "fit_examples": sum(len(b) for b in fit),
        "heldout_examples": sum(len(b) for b in held),
        "fit_tokens": sum(int(b.mask.sum()) for b in fit),
        "heldout_tokens": sum(int(b.mask.sum()) for b in held),
    }
    result["view"] = text_view(model, text)
    lap("text")

    bar = prog.step("roles", len(fit) + 1)
    hints = HintAccumulator(hpl)
    roles = head_roles(model, fit, n_induction=s.induction_len, progress=bar, hints=hints)
    bar.close()
    result["roles"] = roles.to_json()
    result["hints"] = hints.result().to_json()
    lap("roles")

    bar = prog.step("importance", len(fit))
    imp = head_importance(model, fit, progress=bar)
    bar.close()
    result["importance"] = imp.to_json()
    result["layer_types"] = by_layer_type(result)
    lap("importance")

    metric = metrics.LMMetric(held) if causal else metrics.EmbeddingMetric(model, held)
    means = ablation.mean_outputs(model, fit) if s.mean_ablation else None
    bar = prog.step("ablation", ablation.count_jobs(s.fractions, s.seeds, means is not None, s.per_layer))
    curves = ablation.ablation_curves(
        model, metric, imp, fractions=s.fractions, seeds=s.seeds, means=means, per_layer=s.per_layer, progress=bar
    )
    bar.close()
    result["ablation"] = curves.to_json()
    lap("ablation")

    if s.prune > 0:
        result["pruning"] = prune_study(model, imp, metric, held, s.prune, out, s.latency_rounds, prog)
        lap("pruning")

    if s.patching:
        bar = prog.step("patching", 0)
        result["patching"] = patching.study(model, s.pairs, progress=bar)
        bar.close()
        lap("patching")

    if s.context:
        from . import long_context

        bar = prog.step(f"long context ({s.context} tokens)", len(hpl))
        paragraphs = corpus.fit_paragraphs + corpus.heldout_paragraphs  # nothing is fitted: all the text
        result["long_context"] = long_context.study(model, paragraphs, s.context, source=corpus.source, progress=bar)
        bar.close()
        lap("long_context")
    return result
