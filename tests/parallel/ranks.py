"""What each rank of the tensor-parallel tests runs, and the same runs on one process.

`run(comm, names, lm_head)` builds each model named in MODELS, shards it over `comm` (when
given) and returns what the tests compare: logits of a full forward (through the fused route and
through the general one, blocks.ROUTE_ROWS = 0), of a short prefill and teacher-forced decode steps over a
contiguous cache (the few-rows route), greedy `generate()` ids, and the cache's K shape.
`run(None, ...)` is the single-process reference: the same models, never sharded. The
models are built from a seed in every process, so every rank holds the same weights.
"""

from __future__ import annotations

import os
import time

import headwise  # noqa: F401 - imported before torch: OpenMP's wait policy (headwise/threads.py)
import torch

from headwise.core.config import ModelConfig

V = 128

# tiny random models (2 layers): 12 KV heads split over N = 2, 3, 4
_LLAMA = dict(arch="llama", vocab_size=V, num_layers=2, max_positions=128, mlp="swiglu", norm="rmsnorm")
_LLAMA |= dict(positions="rope", tie_embeddings=False)
SPECS = {
    "llama-gqa": dict(_LLAMA, d_model=96, num_heads=24, num_kv_heads=12, head_dim=8, d_ff=96),  # G = 2
    "llama-mha-bias": dict(_LLAMA, d_model=96, num_heads=12, head_dim=8, d_ff=80, attn_bias=True, mlp_bias=True),
    "llama-gqa-tied": dict(_LLAMA, d_model=96, num_heads=24, num_kv_heads=12, head_dim=8, d_ff=96, tie_embeddings=True),
    "llama-3kv": dict(_LLAMA, d_model=72, num_heads=9, num_kv_heads=3, head_dim=8, d_ff=96),  # SmolLM2's heads
    "gpt2": dict(arch="gpt2", vocab_size=V, d_model=96, num_layers=2, num_heads=12, d_ff=192, max_positions=64)
    | dict(mlp="gelu", activation="gelu_tanh", positions="learned", attn_bias=True, mlp_bias=True),
    "bert": dict(arch="bert", vocab_size=V, d_model=96, num_layers=2, num_heads=12, d_ff=192, max_positions=64)
    | dict(norm_placement="post", causal=False, lm_head=False, attn_bias=True, mlp_bias=True, type_vocab_size=2),
}
# GQA groups left uneven by pruning (layer 0 keeps 1, 2, 1, 2 ... query heads per KV head)
PRUNE = {0: [0, 5, 8, 13, 16, 21]}


def build(name: str):
    """A model by name: a SPECS entry (random weights from a fixed seed, prepacked linears as
    headwise.load makes them), `<spec>-pruned`, or a builtin checkpoint in fp32."""
    from headwise.models import load
    from headwise.models import GPT2, Bert, Llama
    from headwise.models.packing import pack_linears

    if name in ("smollm2-135m-instruct", "all-minilm-l6-v2"):
        return load(name, weights="fp32")
    base = name.removesuffix("-pruned")
    cfg = ModelConfig(name=base, **SPECS[base])
    torch.manual_seed(0)
    model = {"llama": Llama, "gpt2": GPT2, "bert": Bert}[cfg.arch](cfg).eval()
    with torch.no_grad():  # logits of a few units: linears 2x nn.Linear's init, embeddings N(0, 0.3^2)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(2.0)
            elif isinstance(m, torch.nn.Embedding):
                m.weight.mul_(0.3)
    pack_linears(model)
    if name.endswith("-pruned"):
        from headwise.analysis.prune import prune_heads

        prune_heads(model, PRUNE)
    return model


def ids(B: int, T: int, seed: int, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def outputs(model) -> dict:
    """What the tests compare, from one model (sharded or not)."""
    from headwise import generate
    from headwise.cache import ContiguousKVCache

    cfg = model.config
    vocab = cfg.vocab_size
    if cfg.arch == "bert":
        x = ids(2, 9, 1, vocab)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        return {"hidden": model(x, mask), "hidden_long": model(ids(2, 40, 2, vocab))}
    out = {}
    if model.tokenizer is None:  # 80 rows (on the tiny models; SmolLM2 steps are short): both routes
        from headwise.models import blocks

        out["logits"] = model(ids(2, 40, 1, vocab))  # the fused route, oneDNN's matmuls
        route, blocks.ROUTE_ROWS = blocks.ROUTE_ROWS, 0
        try:
            out["logits_general"] = model(ids(2, 40, 1, vocab))
        finally:
            blocks.ROUTE_ROWS = route
    B, T, steps = 2, 5, 3
    cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, T + steps, cfg.head_dim)
    feed = ids(B, T + steps, 3, vocab)
    decode = [model(feed[:, :T], cache.step(T))]
    for t in range(T, T + steps):
        decode.append(model(feed[:, t : t + 1], cache.step(1)))  # teacher-forced: no argmax to diverge on
    out["decode"] = torch.cat(decode, dim=1)  # (B, T + steps, V)
    out["cache_k"] = tuple(cache.layer(0).store.k[0].shape)  # (B, Hkv, S, D)
    prompt = [5, 17, 3, 99, 42] if model.tokenizer is None else "The capital of France is"
    out["greedy"] = generate(model, prompt, max_new_tokens=8, temperature=0).token_ids
    if model.tokenizer is None:  # unseeded sampling draws alike on every rank (shard seeds them alike)
        out["sampled"] = generate(model, prompt, max_new_tokens=8, temperature=1.0).token_ids
    return out


ENGINE_PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 1, 2], [7, 8, 9, 10, 11, 12, 13, 14, 3], [5, 6], [40, 41, 42, 43, 44]]
ENGINE_PROMPTS += [[7, 8, 9, 10, 11, 12, 13, 14, 60, 61, 62], [90] * 9]  # shared 8-token prefixes: 2 blocks of 4


def engine_outputs(comm, name: str) -> dict:
    """Greedy ids of ENGINE_PROMPTS through the engine: sharded (rank 0 leads, the rest follow)
    or, with comm None, the engine and generate() on one process. A pool of 12 blocks of 4
    for 6 prompts of up to 11 + 8 tokens: prefix sharing and preemption both happen."""
    from headwise import generate
    from headwise.engine import Engine, EngineConfig
    from headwise.generation import SamplingParams
    from headwise.parallel import follow, lead, release, shard

    config = EngineConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    model = build(name)
    if comm is None:
        engine = Engine(model, config)
        out = {"engine": [o.token_ids for o in engine.generate(ENGINE_PROMPTS, params)]}
        out["preempted"] = engine.stats().preemptions
        engine.shutdown()
        out["generate"] = [generate(model, p, params).token_ids for p in ENGINE_PROMPTS]
        return out
    shard(model, comm)
    if comm.rank:
        return {"steps": follow(model, comm, config)}
    engine = lead(model, comm, config)
    out = {"engine": [o.token_ids for o in engine.generate(ENGINE_PROMPTS, params)]}
    out["preempted"], out["prefix_hits"] = engine.stats().preemptions, engine.stats().prefix_cache_hits
    release(engine)
    return out


def engine_pool_sizes(comm, follower_blocks) -> dict:
    """Rank 0 leads with a pool of 12 blocks of 4; the followers' config says num_blocks =
    `follower_blocks`: None (unset: they take rank 0's count) or another count (refused)."""
    from headwise.engine import EngineConfig
    from headwise.generation import SamplingParams
    from headwise.parallel import ParallelError, follow, lead, release, shard

    config = EngineConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    model = shard(build("llama-gqa"), comm)
    if comm.rank:
        return {"steps": follow(model, comm, config.replace(num_blocks=follower_blocks))}
    engine = lead(model, comm, config)
    try:
        outs = engine.generate(ENGINE_PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    except RuntimeError as e:
        engine.shutdown()
        error = e if isinstance(e, ParallelError) else e.__cause__ or e  # generate() wraps the engine's own
        return {"error": f"{type(error).__name__}: {error}"}
    release(engine)
    return {"engine": [o.token_ids for o in outs], "blocks": engine.cache.num_blocks}


def run(comm, names: list[str]) -> dict:
    """{name: outputs} for each model, sharded over comm (None: one process, not sharded).
    `name@vocab` splits the output head over the vocabulary; a split that shard refuses
    gives {"error": its message}."""
    from headwise.parallel import shard

    results = {}
    for name in names:
        if name.startswith("engine:"):
            results[name] = engine_outputs(comm, name.removeprefix("engine:"))
            continue
        base, _, lm_head = name.partition("@")
        model = build(base)
        if comm is not None:
            try:
                shard(model, comm, lm_head=lm_head or "replicated")
            except ValueError as e:
                results[name] = {"error": str(e)}
                continue
        results[name] = outputs(model)
    return results


def die_mid_run(comm, how: str) -> dict:
    """Rank 1 leaves after the first step (`exit`: the process ends; `stall`: it stops taking
    part for longer than the group's timeout); the others carry on and must fail, not hang."""
    from headwise import generate
    from headwise.parallel import shard

    model = shard(build("llama-gqa"), comm)
    t0 = time.perf_counter()
    generate(model, [1, 2, 3], max_new_tokens=1, temperature=0)
    if comm.rank == 1:
        if how == "exit":
            os._exit(3)
        time.sleep(2.5)  # silent, alive: longer than the test's 1 s group timeout
        return {"stalled": True}
    t0 = time.perf_counter()
    try:
        generate(model, [1, 2, 3], max_new_tokens=4, temperature=0)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def wait_to_be_killed(comm) -> None:
    """A RankGroup follower that only waits: the test kills it."""
    time.sleep(120)
