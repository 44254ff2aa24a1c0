"""Heads across processes with torch.distributed (tensor parallelism, Megatron-style).

    comm = init()                     # under torchrun; or spawn(fn, N) runs fn(comm, ...) on N local ranks
    shard(model, comm)                # rank r keeps Hkv/N KV heads with their query heads
    generate(model, prompt)           # unchanged: two all-reduces a layer inside the model
    engine = lead(model, comm) / follow(model, comm)   # the engine: rank 0 schedules, all ranks run

comm.py: the group, its collectives, ParallelError; layers.py: slices of a linear and the
row-parallel / vocab-parallel modules; shard.py: which heads and units each rank keeps;
engine.py: the engine's steps on every rank; launch.py: local processes for tests and benchmarks
(spawn) and for a server that leads them (RankGroup); local.py: generate() over N local ranks.
"""

from .comm import Comm, ParallelError, init
from .engine import follow, lead, release
from .launch import RankGroup, RankOutcome, RanksFailed, spawn
from .local import generate_on_ranks
from .shard import check_kv_heads, check_world_size, legal_world_sizes, shard

__all__ = [
    "Comm",
    "ParallelError",
    "RankGroup",
    "RankOutcome",
    "RanksFailed",
    "check_kv_heads",
    "check_world_size",
    "follow",
    "generate_on_ranks",
    "init",
    "lead",
    "legal_world_sizes",
    "release",
    "shard",
    "spawn",
]
