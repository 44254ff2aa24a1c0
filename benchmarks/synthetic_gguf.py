"""A Llama-shaped GGUF with random weights, for timing models larger than the shipped SmolLM2
(no model hub here, so no real 7B checkpoint): Llama-2-7B's shape by default (C 4096, 32 layers,
32 heads, FFN 11008) with a byte-level vocabulary of 261 tokens (so the embedding and head are
small: 0.03% of the weights instead of 3.9%), the linears in llama-quantize's mix of a given type
(headwise.core.formats.mix_format: Q4_K_M puts V and the down projections in Q6_K in 16 of 32 layers),
quantized from N(0, 0.02) weights by headwise's quantizers (blocks bit for bit ggml's reference).
llama.cpp and headwise load the same file; speed depends on the bytes and the shapes, not on what
the weights say.

    .venv/bin/python benchmarks/synthetic_gguf.py                      # llama-2-7b in q4_k_m (~3.8 GiB)
    .venv/bin/python benchmarks/synthetic_gguf.py --layers 8 --mix q8_0  # a smaller or other variant

Writes <cache>/synthetic/<name>.gguf (made once; --force remakes it) and prints the path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import headwise  # noqa: E402,F401  (before torch: its OpenMP settings)
import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from headwise.core.formats import MIXES, QUANT_FORMATS, mix_format, target_format  # noqa: E402
from headwise.kernels import quant  # noqa: E402
from headwise.core.paths import default_cache_dir  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SHAPES = {  # GGUF tensor (its llama.cpp role too) -> (rows, cols) in terms of C, F, H*D, Hkv*D
    "attn_q": ("HD", "C"),
    "attn_k": ("KD", "C"),
    "attn_v": ("KD", "C"),
    "attn_output": ("C", "HD"),
    "ffn_gate": ("F", "C"),
    "ffn_up": ("F", "C"),
    "ffn_down": ("C", "F"),
}


def write(path: Path, *, C: int, layers: int, heads: int, kv_heads: int, ffn: int, mix: str, seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    D = C // heads
    dims = {"C": C, "F": ffn, "HD": heads * D, "KD": kv_heads * D}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e"]  # llama.cpp wants some merges
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    V = len(tokens)
    tmp = path.with_suffix(".part")  # written under a temporary name, renamed when whole
    w = gguf.GGUFWriter(str(tmp), "llama")
    for key, value in {
        "context_length": 4096,
        "embedding_length": C,
        "block_count": layers,
        "feed_forward_length": ffn,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.dimension_count": D,
        "vocab_size": V,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")  # a pre-tokenizer both llama.cpp and headwise know
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, rows: int, cols: int, role: str, layer: int) -> None:
        x = torch.randn(rows, cols, generator=gen) * 0.02
        fmt = mix_format(mix, role, layer, layers, cols) if mix in MIXES else target_format(mix, cols)
        if fmt is None:
            w.add_tensor(name, x.numpy())
            return
        blocks = quant.quantize(x, fmt).numpy()
        w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(QUANT_FORMATS[fmt][0]))

    add("token_embd.weight", V, C, "output", 0)  # tied: the head's type, as llama-quantize gives it
    w.add_tensor("output_norm.weight", np.ones(C, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(C, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(C, np.float32))
        for role, (rows, cols) in SHAPES.items():
            add(f"blk.{i}.{role}.weight", dims[rows], dims[cols], role, i)
        print(f"  layer {i + 1}/{layers}", end="\r", file=sys.stderr, flush=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096, help="C, the hidden width (default 4096)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument(
        "--mix", default="q4_k_m", help=f"a mix ({', '.join(MIXES)}) or a format ({', '.join(QUANT_FORMATS)})"
    )
    ap.add_argument("--force", action="store_true", help="write the file again even if it exists")
    args = ap.parse_args(argv)
    name = f"llama-C{args.width}-L{args.layers}-H{args.heads}-{args.kv_heads}-F{args.ffn}-{args.mix}.gguf"
    path = default_cache_dir() / "synthetic" / name
    if args.force or not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write(
            path, C=args.width, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, mix=args.mix
        )
        print(
            f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
