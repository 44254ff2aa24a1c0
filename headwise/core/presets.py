"""The named presets' fields (plain data; `headwise.config` builds the ModelConfigs).

A preset is the keyword arguments of `ModelConfig`; one with `base` is that preset's
`ModelConfig.override(**the rest)`. The data lives apart from config.py so that both
files stay small, and holds no imports so that config.py can read it without a cycle.
`headwise.config.PRESETS` / `get_preset` are what callers use.
"""

# Sources: BERT, Devlin et al. 2018 (arXiv:1810.04805) + google-research/bert
# configs; GPT-2, Radford et al. 2019 + openai/gpt-2 hparams; GPT-3, Brown et
# al. 2020 (arXiv:2005.14165) Table 2.1; Llama 2, Touvron et al. 2023
# (arXiv:2307.09288) + meta-llama/Llama-2-*-hf config.json; SmolLM2 and
# all-MiniLM-L6-v2 from their Hugging Face config.json files.

_BERT_BASE = dict(
    name="bert-base",
    arch="bert",
    vocab_size=30522,  # WordPiece vocab of bert-base-uncased
    d_model=768,
    num_layers=12,
    num_heads=12,  # D = 64, the original Transformer's per-head width
    d_ff=3072,  # 4 * C, as in the original Transformer
    max_positions=512,  # learned table; the last 10% of pretraining used 512-token sequences
    mlp="gelu",
    norm="layernorm",
    norm_placement="post",  # LayerNorm after each residual add, plus one on embeddings
    positions="learned",
    tie_embeddings=True,  # the MLM decoder shares the word embeddings
    attn_bias=True,
    mlp_bias=True,
    type_vocab_size=2,  # sentence A / sentence B for next-sentence prediction
    pooler=True,  # dense + tanh over [CLS] for NSP; in BertModel's 109.48M
    causal=False,  # bidirectional encoder: no KV cache
    lm_head=False,  # BertModel (what checkpoints load into) ends at hidden states
    norm_eps=1e-12,  # google-research/bert's LayerNorm epsilon
)

_GPT2 = dict(
    name="gpt2",
    arch="gpt2",
    vocab_size=50257,  # 50257 BPE tokens: 50,000 merges + 256 bytes + <|endoftext|>
    d_model=768,
    num_layers=12,
    num_heads=12,  # D = 64
    d_ff=3072,  # 4 * C
    max_positions=1024,  # learned table; GPT-2 doubled GPT-1's 512
    mlp="gelu",
    norm="layernorm",
    norm_placement="pre",  # GPT-2 moved LayerNorm to the block input, plus a final one
    positions="learned",
    tie_embeddings=True,  # LM head is wte^T
    attn_bias=True,  # c_attn and c_proj are Conv1D with bias
    mlp_bias=True,
    activation="gelu_tanh",  # "gelu_new": the tanh approximation openai/gpt-2 trained with
    eos_token_ids=(50256,),  # <|endoftext|>
)

_GPT3_175B = dict(
    name="gpt3-175b",
    arch="gpt3",
    vocab_size=50257,  # same BPE as GPT-2
    d_model=12288,
    num_layers=96,
    num_heads=96,
    head_dim=128,  # Table 2.1 d_head; equals C / H
    d_ff=4 * 12288,  # Table 2.1: d_ff = 4 * d_model at every size
    max_positions=2048,  # n_ctx for every GPT-3 size
    mlp="gelu",
    norm="layernorm",
    norm_placement="pre",
    positions="learned",
    tie_embeddings=True,  # same design as GPT-2
    attn_bias=True,
    mlp_bias=True,
    # GPT-3 alternates dense and locally banded sparse attention; that changes
    # FLOPs of the sparse layers but not any weight shape. We count all dense.
)

_LLAMA2_7B = dict(
    name="llama-2-7b",
    arch="llama",
    vocab_size=32000,  # SentencePiece BPE from Llama 1
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,  # only the 34B and 70B Llama 2 models use GQA
    head_dim=128,
    d_ff=11008,  # ~ 2/3 * 4C for SwiGLU's three matrices, rounded up to a multiple of 256
    max_positions=4096,  # Llama 2 doubled Llama 1's 2048
    mlp="swiglu",
    norm="rmsnorm",
    norm_placement="pre",
    positions="rope",
    tie_embeddings=False,  # separate lm_head: 131M more parameters
    attn_bias=False,
    mlp_bias=False,
)

_LLAMA2_70B = dict(
    base=_LLAMA2_7B["name"],  # the other preset's fields, with these changed (ModelConfig.override)
    name="llama-2-70b",
    d_model=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,  # GQA, G = 8: an 8x smaller KV cache than MHA
    head_dim=128,
    d_ff=28672,  # 1.3 * (2/3 * 4C) rounded up to 4096; a wider MLP buys back what GQA takes from K, V
)

_SMOLLM2_135M = dict(
    name="smollm2-135m",
    arch="llama",
    vocab_size=49152,  # SmolLM's own BPE, 48 * 1024
    d_model=576,
    num_layers=30,  # deep and narrow: MobileLLM found depth pays more than width at this size
    num_heads=9,
    num_kv_heads=3,  # GQA, G = 3
    head_dim=64,
    d_ff=1536,
    max_positions=8192,  # max_position_embeddings in its config.json
    mlp="swiglu",
    norm="rmsnorm",
    norm_placement="pre",
    positions="rope",
    tie_embeddings=True,  # the embedding is 28M of 135M parameters; one copy, not two
    attn_bias=False,
    mlp_bias=False,
    rope_theta=100000.0,  # config.json rope_theta: a longer base for its 8192 context
)

_MINILM_L6 = dict(
    base=_BERT_BASE["name"],  # the other preset's fields, with these changed (ModelConfig.override)
    name="all-minilm-l6-v2",
    d_model=384,
    num_layers=6,  # every second layer of MiniLM-L12-H384, then contrastive fine-tuning
    num_heads=12,  # D = 32: BERT-base's 12 heads at half its 64 width
    d_ff=1536,  # 4 * C
    # vocab, positions, token types and pooler are BERT's: same tokenizer and layout
)

# In this order (a preset's base comes before it); PRESETS keeps it.
PRESET_FIELDS: tuple[dict, ...] = (_BERT_BASE, _GPT2, _GPT3_175B, _LLAMA2_7B, _LLAMA2_70B, _SMOLLM2_135M, _MINILM_L6)

ALIASES = {
    "bert-base-uncased": "bert-base",
    "bert": "bert-base",
    "gpt2-small": "gpt2",
    "gpt-2": "gpt2",
    "gpt3": "gpt3-175b",
    "gpt-3": "gpt3-175b",
    "llama2-7b": "llama-2-7b",
    "llama-2-7b-hf": "llama-2-7b",
    "llama2-70b": "llama-2-70b",
    "llama-2-70b-hf": "llama-2-70b",
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "all-minilm-l6": "all-minilm-l6-v2",
    "minilm": "all-minilm-l6-v2",
}
