"""Every decoder family against Hugging Face transformers (the independent reference), each from a
tiny random checkpoint saved by save_pretrained and loaded with `headwise.load(dir)`.

Sequences are longer than the window (W = 8, 24 tokens) so that windowed layers really drop keys;
norm weights are randomized (HF initializes Gemma's w to 0 and Llama's to 1, which would hide a
wrong (1 + w) convention). Checked per family: the plain forward's logits, a prefill then one token
at a time through a KV cache, greedy generate() against HF's greedy generate, and both executors.
"""

import pytest
import torch

import headwise
from headwise.cache import ContiguousKVCache
from headwise.generation import generate
from headwise.models import blocks
from headwise.models.loading import CheckpointError

from ..helpers import save_hf

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

TOL = 1e-4
V, W, T = 128, 8, 24  # vocab, window, tokens (> W)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    vocab_size=V,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)  # no eos: HF generate runs the full length, as ours does


def _gemma(**kw):
    return dict(BASE, head_dim=16, sliding_window=W, query_pre_attn_scalar=24, **kw)


FAMILIES = {
    # a window on every layer: the issue measured 0.75 max error here before the window was applied
    "mistral": lambda: (
        tf.MistralConfig(**BASE, num_hidden_layers=2, num_key_value_heads=2, sliding_window=W),
        tf.MistralForCausalLM,
    ),
    # q/k/v biases; windows from max_window_layers on (layer 0 global, 1 and 2 local)
    "qwen2": lambda: (
        tf.Qwen2Config(
            **BASE,
            num_hidden_layers=3,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=W,
            max_window_layers=1,
        ),
        tf.Qwen2ForCausalLM,
    ),
    # QK-norm, head_dim != C / H
    "qwen3": lambda: (
        tf.Qwen3Config(
            **BASE,
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=W,
            max_window_layers=2,
        ),
        tf.Qwen3ForCausalLM,
    ),
    # fused qkv_proj and gate_up_proj; RoPE over half of each head; a window on every layer
    "phi3": lambda: (
        tf.Phi3Config(**BASE, num_hidden_layers=2, num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=W),
        tf.Phi3ForCausalLM,
    ),
    # local/global alternating, pre+post norms, GeGLU, small soft-caps so that they bite
    "gemma2": lambda: (
        tf.Gemma2Config(
            **_gemma(num_hidden_layers=4, num_key_value_heads=2, attn_logit_softcapping=2.0),
            final_logit_softcapping=3.0,
        ),
        tf.Gemma2ForCausalLM,
    ),
    # MQA, 5 local : 1 global (HF's default pattern), QK-norm, local and global RoPE bases, the
    # global one linearly scaled
    "gemma3": lambda: (
        tf.Gemma3TextConfig(
            **_gemma(num_hidden_layers=6, num_key_value_heads=1),
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        ),
        tf.Gemma3ForCausalLM,
    ),
}


def random_hf(name: str):
    """A seeded random transformers model of family `name`, its norm weights random too."""
    torch.manual_seed(1234)
    config, cls = FAMILIES[name]()
    hf = cls(config).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)  # Gemma's norms are 1 + w: w = 0 would hide the +1
    return hf


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> (HF model, headwise model loaded from HF's saved checkpoint), built once."""
    made = {}

    def get(name):
        if name not in made:
            hf = random_hf(name)
            made[name] = hf, headwise.load(save_hf(tmp_path_factory, name, hf))
        return made[name]

    return get


def _ids(B, n, seed=0):
    return torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(seed))


def test_configs_say_the_block():
    from headwise.models.families import gemma3

    mistral = FAMILIES["mistral"]()[0].to_dict()
    cfg = headwise.models.loading.family_of(mistral).config_from_hf(mistral)
    assert cfg.windows == (W, W)
    g = gemma3.config_from_hf(FAMILIES["gemma3"]()[0].to_dict())
    assert g.windows == (W,) * 5 + (None,) and g.num_kv_heads == 1 and g.qk_norm and g.post_norms
    assert (g.rope_local_theta, g.rope_theta, g.rope_scaling.kind, g.embed_scale) == (1e4, 1e6, "linear", 8.0)
    assert g.activation == "gelu_tanh" and g.attn_scale == 24**-0.5 and g.final_softcap is None


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_logits_match_hf_past_the_window(family, name):
    hf, model = family(name)
    ids = _ids(2, T)
    want = hf(ids).logits
    for route in (None, 0):  # whatever executor is chosen, and the reference (the modules as written)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(blocks, "ROUTE_ROWS", route)
            got = model(ids)
        assert got.shape == want.shape == (2, T, V)
        assert (got - want).abs().max() <= TOL, (name, route)


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_prefill_then_decode_through_a_cache_matches_hf(family, name):
    hf, model = family(name)
    cfg = model.config
    ids = _ids(2, T, seed=1)
    want = hf(ids).logits
    cache = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, T, cfg.head_dim)
    steps = [model(ids[:, :10], cache=cache)]  # prefill 10 (> W)
    steps += [model(ids[:, t : t + 1], cache=cache) for t in range(10, T)]  # then one token at a time
    assert (torch.cat(steps, dim=1) - want).abs().max() <= TOL


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_greedy_generate_matches_hf(family, name):
    hf, model = family(name)
    prompt = _ids(1, 12, seed=2)
    want = hf.generate(prompt, do_sample=False, max_new_tokens=14, attention_mask=torch.ones_like(prompt))
    got = generate(model, prompt[0].tolist(), max_new_tokens=14, temperature=0.0)
    assert got.token_ids == want[0, 12:].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_engine_greedy_matches_hf(family, name):
    """The engine's paged cache (windowed layers in their own block groups), prompts of 5 and 20 tokens
    prefilled in chunks of 16 beside other sequences' decodes: each sequence as HF's greedy generate."""
    from headwise import Engine, SamplingParams

    hf, model = family(name)
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (5, 20)]
    engine = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    for p, out in zip(prompts, outs):
        ones = torch.ones(1, len(p), dtype=torch.long)
        want = hf.generate(torch.tensor([p]), attention_mask=ones, do_sample=False, max_new_tokens=12)
        assert out.token_ids == want[0, len(p) :].tolist(), len(p)


@pytest.mark.parametrize(
    "model_type, option, message",
    [
        ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"layer_types": ["chunked_attention"] * 2, "sliding_window": 8}, "chunked_attention"),
        ("gemma3", {}, "no text_config"),  # a Gemma3Config without its text model
    ],
)
def test_unsupported_options_name_themselves(model_type, option, message):
    from headwise.models.loading import family_of

    hf = dict(BASE, model_type=model_type, num_hidden_layers=2, **option)
    with pytest.raises(CheckpointError, match=message):
        family_of(hf).config_from_hf(hf)


@torch.no_grad()
def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (model_type "gemma3"): its text_config and its
    language-model weights; the vision tower and projector are left unread."""
    torch.manual_seed(5)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = tf.Gemma3Config(
        text_config=_gemma(num_hidden_layers=6, num_key_value_heads=1),
        vision_config=dict(vision, patch_size=14),
        mm_tokens_per_image=4,
        boi_token_index=V - 3,
        eoi_token_index=V - 2,
        image_token_index=V - 1,
    )
    hf = tf.Gemma3ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = headwise.load(tmp_path)
    ids = _ids(1, T, seed=3) % (V - 3)  # text tokens only
    assert model.config.windows == (W,) * 5 + (None,)
    assert (model(ids) - hf(input_ids=ids).logits).abs().max() <= TOL


def test_transformers_4_configs_read_the_same():
    """config.json as transformers 4 wrote it: rope_theta + rope_scaling + rope_local_base_freq, the
    5:1 pattern as sliding_window_pattern (no layer_types), Gemma 2's alternation implied."""
    from headwise.models.families import gemma2, gemma3

    v4 = dict(BASE, num_hidden_layers=6, num_key_value_heads=1, head_dim=16, sliding_window=W)
    g3 = gemma3.config_from_hf(
        dict(
            v4,
            model_type="gemma3_text",
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window_pattern=3,
        )
    )
    assert g3.windows == (W, W, None, W, W, None) and g3.rope_local_theta == 1e4 and g3.rope_theta == 1e6
    assert g3.rope_scaling.kind == "linear" and g3.rope_scaling.factor == 8.0 and g3.tie_embeddings
    g2 = gemma2.config_from_hf(dict(v4, model_type="gemma2", attn_logit_softcapping=50.0))
    assert g2.windows == (W, None) * 3 and g2.rope_local_theta is None and g2.attn_softcap == 50.0
    from headwise.models.families import qwen2

    q = dict(v4, model_type="qwen2", max_window_layers=4)
    assert qwen2.config_from_hf(q).windows == (None,) * 6  # use_sliding_window unset: no window
    assert qwen2.config_from_hf(dict(q, use_sliding_window=True)).windows == (None,) * 4 + (W, W)
