"""Head analysis: see, label, attribute, score, ablate and prune the heads of any headwise model.

    from headwise.analysis import capture, head_roles, head_importance, prune_heads
    batch, cap = capture(model, "The bank approved the loan.", points=("pattern", "result"))

hooks.py (capture points, interventions) -> capture.py (patterns for texts) ->
roles.py, attribution.py, importance.py, ablation.py, prune.py, patching.py + dla.py
(cause: activation patching, direct logit attribution) -> analyze.py (the
whole study) -> report.py (figures, HTML, JSON) -> headwise/cli/analyze.py (`headwise analyze`).
"""

from .ablation import ablation_curves, mean_outputs
from .analyze import DEFAULT_TEXT, Settings, analyze
from .attribution import HintAccumulator, rollout, value_norms, weighted_norms
from .capture import Batch, capture, encode, from_ids
from .corpus import load_corpus
from .dla import Attribution, direct_logit_attribution
from .hooks import POINTS, Capture, attached, attention_layers, head_results
from .importance import Importance, head_importance
from .long_context import LongContext, long_context_stats
from .metrics import EmbeddingMetric, LMMetric
from .pairs import Pair, load_pairs
from .patching import Patching, patch_heads
from .prune import load_pruned, param_count, prune_heads, save_pruned
from .roles import HeadRoles, head_roles

__all__ = [
    "ablation_curves",
    "mean_outputs",
    "DEFAULT_TEXT",
    "Settings",
    "analyze",
    "HintAccumulator",
    "rollout",
    "value_norms",
    "weighted_norms",
    "Batch",
    "capture",
    "encode",
    "from_ids",
    "load_corpus",
    "Attribution",
    "direct_logit_attribution",
    "POINTS",
    "Capture",
    "attached",
    "attention_layers",
    "head_results",
    "Importance",
    "head_importance",
    "LongContext",
    "long_context_stats",
    "EmbeddingMetric",
    "LMMetric",
    "Pair",
    "load_pairs",
    "Patching",
    "patch_heads",
    "load_pruned",
    "param_count",
    "prune_heads",
    "save_pruned",
    "HeadRoles",
    "head_roles",
]
