"""The bottom room: plain data and counts, no torch.

config (frozen dataclasses) and presets, formats (GGML block formats as data), plan and
plan_report (params / FLOPs / KV bytes on a budget), paths (the cache directory), threads
(OpenMP's wait policy, set before torch loads). Nothing here imports another headwise room.
"""
