"""headwise.load / from_hf: file formats, dispatch, dtypes, and the errors for bad input."""

import json

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import headwise
from headwise.models import CheckpointError, from_hf

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

V = 96


def _llama_hf(**kw):
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        **kw,
    )
    return tf.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    hf = _llama_hf()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=V)).eval()
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = tf.BertModel(
        tf.BertConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=V,
            max_position_embeddings=16,
        )
    ).eval()
    path = tmp_path_factory.mktemp("bert")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _copy(src, dst, *, tensors=None, config=None):
    """A checkpoint dir like src, with its tensors and/or config replaced."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    t = load_file(src / "model.safetensors")
    save_file(tensors(t) if tensors else t, dst / "model.safetensors")
    return dst


IDS = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------- formats and dispatch


@torch.no_grad()
def test_sharded_safetensors_and_pytorch_bin_load_the_same(llama_dir, tmp_path):
    hf, path = llama_dir
    want = headwise.load(path)(IDS)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert torch.equal(headwise.load(tmp_path / "sharded")(IDS), want)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((path / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert torch.equal(headwise.load(tmp_path / "bin")(IDS), want)


def test_meta_build_leaves_nothing_on_meta_and_ties_share_one_tensor(tmp_path):
    hf = _llama_hf(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = headwise.load(tmp_path)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model.lm_head.weight is model.embed.weight
    assert model.layers[0].attn.rope is model.layers[1].attn.rope is model.rope  # cos/sin computed once
    assert model.rope.inv_freq.dtype == torch.float32
    assert model.tokenizer is None and not model.training
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())


@torch.no_grad()
def test_dtype_and_from_hf_leaves_its_input_alone(llama_dir):
    hf, path = llama_dir
    model = headwise.load(path, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.inv_freq.dtype == torch.float32  # positions stay exact
    assert model(IDS).dtype == torch.float32  # logits are fp32
    tensors = dict(hf.state_dict())
    before = set(tensors)
    model = from_hf(json.loads((path / "config.json").read_text()), tensors, dtype=torch.float64)
    assert set(tensors) == before and model.embed.weight.dtype == torch.float64


@torch.no_grad()
def test_prefixless_and_legacy_names_load(gpt2_dir, bert_dir, tmp_path):
    """openai's GPT2Model upload has no `transformer.` prefix; BertForMaskedLM adds `bert.` and MLM heads."""
    hf, path = gpt2_dir
    bare = _copy(path, tmp_path / "gpt2", tensors=lambda t: {k.removeprefix("transformer."): v for k, v in t.items()})
    assert torch.equal(headwise.load(bare)(IDS), headwise.load(path)(IDS))
    torch.manual_seed(0)
    mlm = tf.BertForMaskedLM(
        tf.BertConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=V,
            max_position_embeddings=16,
        )
    ).eval()
    mlm.save_pretrained(tmp_path / "mlm", safe_serialization=True)
    model = headwise.load(tmp_path / "mlm")
    assert (model(IDS) - mlm.bert(IDS).last_hidden_state).abs().max() <= 1e-4


def test_gguf_and_builtin_names_dispatch(llama_dir, tmp_path, monkeypatch):
    import headwise.models.builtin as builtin
    import headwise.models.gguf as gguf

    hf, path = llama_dir
    config = json.loads((path / "config.json").read_text())
    calls = []

    def fake_read_gguf(p, *args, **kwargs):
        calls.append(p)
        return config, dict(hf.state_dict()), "the tokenizer"

    monkeypatch.setattr(gguf, "read_gguf", fake_read_gguf)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = headwise.load(tmp_path / "m.gguf")
    assert calls and model.tokenizer == "the tokenizer"
    monkeypatch.setattr(builtin, "resolve", {"tiny-llama": path}.__getitem__)  # KeyError for other names
    assert headwise.load("tiny-llama").config.num_kv_heads == 2


def test_tokenizer_is_attached_when_the_directory_has_one(bert_dir, tmp_path):
    _, path = bert_dir
    d = _copy(path, tmp_path / "tok")
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    tok = headwise.load(d).tokenizer
    assert tok is not None and tok.token_to_id("hello") == 5


def test_configs_from_hf():
    from headwise.models import llama

    base = dict(
        hidden_size=64,
        num_attention_heads=8,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=V,
        max_position_embeddings=128,
    )
    qwen = llama.config_from_hf({**base, "model_type": "qwen2", "num_key_value_heads": 2, "eos_token_id": [5, 6]})
    assert (qwen.attn_bias, qwen.out_bias, qwen.num_kv_heads, qwen.head_dim) == (True, False, 2, 8)
    assert qwen.eos_token_ids == (5, 6)
    v4 = llama.config_from_hf(
        {
            **base,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32},
        }
    )
    assert v4.rope_theta == 5e5 and v4.rope_scaling.kind == "llama3" and v4.rope_scaling.original_max_positions == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the window is applied now: nothing to warn about
        mistral = llama.config_from_hf({**base, "model_type": "mistral", "sliding_window": 8})
    assert mistral.sliding_window == 8 and mistral.windows == (8, 8)


# ---------------------------------------------------------------------------- bad input


def test_missing_misshaped_and_unused_tensors_are_all_named(llama_dir, tmp_path):
    _, path = llama_dir

    def damage(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
        t["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(8)
        return t

    bad = _copy(path, tmp_path / "bad", tensors=damage)
    with pytest.raises(CheckpointError) as err:
        headwise.load(bad)
    msg = str(err.value)
    assert str(bad / "model.safetensors") in msg
    assert "missing (1):\n    model.layers.1.mlp.up_proj.weight" in msg
    assert "wrong shape (1):\n    model.layers.0.self_attn.k_proj.weight: (8, 32), expected (16, 32)" in msg
    assert "unused" in msg and "model.layers.0.self_attn.q_norm.weight" in msg


def test_untied_checkpoint_without_lm_head_is_missing_it(llama_dir, tmp_path):
    _, path = llama_dir
    bad = _copy(path, tmp_path / "nohead", tensors=lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match=r"missing \(1\):\n    lm_head.weight"):
        headwise.load(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: {**c, "model_type": "falcon", "architectures": ["FalconForCausalLM"]},
            r"unknown architecture: model_type='falcon', architectures=\['FalconForCausalLM'\]; supported model_type: llama",
        ),
        (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "config has no 'hidden_size'"),
        (
            lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "rope scaling type 'yarn' is not supported",
        ),
        (lambda c: {**c, "hidden_act": "mish"}, "activation 'mish' is not supported"),
    ],
)
def test_bad_configs(llama_dir, tmp_path, change, message):
    _, path = llama_dir
    with pytest.raises(CheckpointError, match=message):
        headwise.load(_copy(path, tmp_path / "c", config=change))


def test_corrupt_or_absent_files_name_the_file(llama_dir, tmp_path):
    _, path = llama_dir
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text((path / "config.json").read_text())
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match=f"{d / 'model.safetensors'} is not a readable safetensors file"):
        headwise.load(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*expected model.safetensors"):
        headwise.load(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"no config.json in {d}"):
        headwise.load(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        headwise.load(d)
    with pytest.raises(FileNotFoundError, match="'nowhere/at-all' is neither a checkpoint directory"):
        headwise.load("nowhere/at-all")


def test_sharded_index_naming_a_missing_shard(llama_dir, tmp_path):
    hf, _ = llama_dir
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard {shard} .* does not exist"):
        headwise.load(tmp_path)


@torch.no_grad()
def test_too_long_inputs_for_learned_positions(gpt2_dir, bert_dir):
    gpt2, bert = headwise.load(gpt2_dir[1]), headwise.load(bert_dir[1])
    long = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids has 17 tokens but this GPT-2 model has 16 learned positions"):
        gpt2(long)
    with pytest.raises(ValueError, match="input_ids has 17 tokens but this BERT model has 16 learned positions"):
        bert(long)
    from headwise.cache import ContiguousKVCache

    cache = ContiguousKVCache(1, 1, 2, 32, 16)
    with pytest.raises(ValueError, match="max_seq_len=32 .* 16 learned positions"):
        gpt2(long[:, :4], cache=cache)


@torch.no_grad()
def test_bad_call_arguments(llama_dir, bert_dir):
    llama, bert = headwise.load(llama_dir[1]), headwise.load(bert_dir[1])
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, T\) = \(2, 10\)"):
        llama(IDS, attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, T\) integer tensor, got \(10,\)"):
        llama(IDS[0])
    with pytest.raises(ValueError, match="token_type_ids has shape"):
        bert(IDS, token_type_ids=IDS[:, :3])
    with pytest.raises(ValueError, match="pool mode 'max' is not one of"):
        bert.pool(bert(IDS), None, "max")
