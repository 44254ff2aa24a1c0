"""`generate()` with a model's heads split over N local processes, in one call.

    out = generate_on_ranks("smollm2-135m-instruct", "The capital of France is", 3, max_new_tokens=8)
    out.text                                    # rank 0's GenerationResult; every rank produced the same

Each rank loads the checkpoint, keeps its share (shard), and runs the same generate(); the
ranks' token ids are compared, so a divergence (which would mean the ranks computed
different logits) is an error rather than a silent wrong answer. For many machines, run your
own script under torchrun with init() + shard() instead.
"""

from __future__ import annotations

from .comm import Comm
from .launch import spawn
from .shard import shard


def _rank_generate(comm: Comm, name: str, prompt, weights: str, lm_head: str, fields: dict):
    from ..generation import generate
    from ..models import load

    model = shard(load(name, weights=weights), comm, lm_head=lm_head)
    return generate(model, prompt, **fields)


def generate_on_ranks(
    name: str,
    prompt,
    world_size: int,
    *,
    weights: str = "auto",
    lm_head: str = "replicated",
    threads: int = 1,
    timeout_s: float = 60.0,
    **fields,
):
    """generate(load(name, weights=weights), prompt, **fields) over `world_size` local ranks
    (see the module doc); threads: torch threads per rank. Returns rank 0's result."""
    results = spawn(
        _rank_generate, world_size, name, prompt, weights, lm_head, fields, threads=threads, timeout_s=timeout_s
    )
    ids = [[r.token_ids for r in res] if isinstance(res, list) else res.token_ids for res in results]
    if any(i != ids[0] for i in ids):
        raise RuntimeError(f"the ranks generated different tokens: {ids}; this is a bug (their logits differ)")
    return results[0]
