"""Heads across processes with torch.distributed (tensor parallelism, Megatron-style).

    comm = init()                     # under torchrun; or spawn(fn, N) runs fn(comm, ...) on N local ranks
    shard(model, comm)                # rank r keeps Hkv/N KV heads with their query heads
    generate(model, prompt)           # unchanged: two all-reduces a layer inside the model

comm.py: the group, its collectives, ParallelError; layers.py: slices of a linear and the
row-parallel / vocab-parallel modules; shard.py: which heads and units each rank keeps;
launch.py: local processes for tests and benchmarks; local.py: generate() over N local ranks.
"""

from .comm import Comm, ParallelError, init
from .launch import RankOutcome, RanksFailed, spawn
from .local import generate_on_ranks
from .shard import check_world_size, legal_world_sizes, shard

__all__ = [
    "Comm",
    "ParallelError",
    "RankOutcome",
    "RanksFailed",
    "check_world_size",
    "generate_on_ranks",
    "init",
    "legal_world_sizes",
    "shard",
    "spawn",
]
