"""Tiny random checkpoints for the tests: configs made with transformers offline, saved with
save_pretrained, so headwise loads them as users load real ones."""

from pathlib import Path


def tiny_llama_config(**overrides):
    """A 2-layer GQA Llama (8 query heads, 2 KV heads, width 64, vocab 128), no special ids
    (so HF generate runs the full length, as our loops do); any field can be overridden."""
    import transformers as tf

    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return tf.LlamaConfig(**{**base, **overrides})


def save_hf(tmp_path_factory, name: str, hf_model) -> Path:
    """hf_model saved (safetensors) into a fresh temp dir named after `name`."""
    path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(path, safe_serialization=True)
    return path
