"""Shared by the model tests: tiny Hugging Face checkpoints made offline, saved once per module,
and the tiny decoder configs they are made from."""

import contextlib
import os

import pytest
import torch

from ..helpers import save_hf

V = 128  # vocab of every tiny decoder here
LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    vocab_size=V,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)  # no eos: HF generate runs the full length, as our loops do


def decoder_configs() -> dict:
    """name -> () -> (HF config, HF model class): 2 layers, width 64, vocab 128, random weights.
    A function so that transformers is imported by the tests that use it, not at collection."""
    import transformers as tf

    def llama(**kw):
        return tf.LlamaConfig(**{**LLAMA, **kw}), tf.LlamaForCausalLM

    return {
        "gpt2": lambda: (
            tf.GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=64,
                vocab_size=V,
                initializer_range=0.3,
                bos_token_id=None,
                eos_token_id=None,
            ),
            tf.GPT2LMHeadModel,
        ),
        "llama-mha": lambda: llama(num_key_value_heads=8),
        "llama-gqa": lambda: llama(num_key_value_heads=2),  # G = 4
        "llama-mqa-tied": lambda: llama(num_key_value_heads=1, tie_word_embeddings=True),
        "llama-bias": lambda: llama(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
        "qwen2": lambda: (tf.Qwen2Config(**LLAMA, num_key_value_heads=2), tf.Qwen2ForCausalLM),  # q/k/v bias
        # Mistral v0.2+: no window (MistralConfig's default 4096 is v0.1's; mistral-window has one)
        "mistral": lambda: (
            tf.MistralConfig(**LLAMA, num_key_value_heads=2, sliding_window=None),
            tf.MistralForCausalLM,
        ),
        # a window shorter than the tests' sequences: HF masks keys older than 6 tokens
        "mistral-window": lambda: (
            tf.MistralConfig(**LLAMA, num_key_value_heads=2, sliding_window=6),
            tf.MistralForCausalLM,
        ),
    }


def hf_checkpoints(tmp_path_factory, configs: dict, seed: int):
    """get(name) -> (HF model in eval mode, its save_pretrained dir); configs[name]() gives
    (config, model class). Built on first use with torch.manual_seed(seed), then reused."""
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(seed)
            config, cls = configs[name]()
            hf = cls(config).eval()
            made[name] = hf, save_hf(tmp_path_factory, name, hf)
        return made[name]

    return get


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """decoder(name) -> (HF model, headwise model loaded from HF's checkpoint) for a name of
    decoder_configs(), built once per module; decoder.path(name) is the checkpoint dir."""
    import headwise

    get = hf_checkpoints(tmp_path_factory, decoder_configs(), seed=1234)
    models = {}

    def load(name):
        if name not in models:
            hf, path = get(name)
            models[name] = hf, headwise.load(path)
        return models[name]

    load.path = lambda name: get(name)[1]
    return load


@pytest.fixture
def few_rows(monkeypatch):
    """Counts the layers the fused executor ran (models/executors.py): `blocks.fused_layer` calls and
    the layers a decode step ran in the C stack (`kernels.layer.run_stack`, one entry per layer)."""
    calls = []
    from headwise.kernels import layer as kernel_layer
    from headwise.models import executors

    real, real_stack = executors.fused_layer, kernel_layer.run_stack

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def spy_stack(steps, x):
        calls.extend([1] * len(steps))
        return real_stack(steps, x)

    monkeypatch.setattr(executors, "fused_layer", spy)
    monkeypatch.setattr(kernel_layer, "run_stack", spy_stack)
    return calls


_READERS: dict = {}  # (path, size, mtime, mode) -> gguf.GGUFReader, for the whole session
_NAME_MAPS: dict = {}  # (arch, n_blocks) -> gguf.TensorNameMap


@contextlib.contextmanager
def transformers_gguf_memo():
    """transformers' GGUF loading (the reference of test_gguf.py and test_tokenizer.py), with two
    pure steps it repeats done once: gguf.GGUFReader of a file (its fields parsed in Python, ~5 s for
    SmolLM2's 49k-token vocabulary, read again by AutoConfig, the tokenizer and the tensor load) and
    gguf.get_tensor_name_map (built anew for each of the ~400 modules it walks: ~12 s). transformers
    only reads both; what it computes from them is unchanged. The reader slices a plain ndarray view
    of its np.memmap instead of the memmap itself: the same mapped bytes, without memmap's
    __array_finalize__ on each of the ~1M slices its parse makes (Gemma 3 270M's 262k-token
    vocabulary: 10.3 -> 4 s)."""
    import gguf
    import numpy as np

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainViews(real_reader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if "_plain" not in self.__dict__:
                self._plain = self.data.view(np.ndarray)  # the file's mapped pages, not a copy
            real_data, self.data = self.data, self._plain
            try:  # gguf's own slicing, on the plain view
                return real_reader._get(self, offset, dtype, count, override_order)
            finally:
                self.data = real_data

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, mode)
        if key not in _READERS:
            _READERS[key] = PlainViews(path, mode)
        return _READERS[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in _NAME_MAPS:
            _NAME_MAPS[arch, n_blocks] = real_map(arch, n_blocks)
        return _NAME_MAPS[arch, n_blocks]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", name_map)
        yield
