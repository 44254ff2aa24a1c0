"""GGUF weights are read from the file where it lies: the cache keeps only the parsed metadata
(config, tokenizer, tensor table), an edited or replaced file is read again, and a load from the
cache builds the same model as a load that parses the file."""

import os

import numpy as np
import pytest
import torch

import headwise
from headwise.models import gguf_cache
from headwise.models.builtin import resolve
from headwise.models.gguf import cache_entry, read_gguf
from tests.models.test_gguf import _same, write_tiny_llama


def _cache_bytes(root) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _equal(a: dict, b: dict) -> bool:
    """Tensors or QuantTensors (blocks, format, shape), name by name."""
    if set(a) != set(b):
        return False
    for name, t in a.items():
        u = b[name]
        if isinstance(t, torch.Tensor):
            if not (isinstance(u, torch.Tensor) and torch.equal(t, u)):
                return False
        elif not (t.fmt == u.fmt and t.shape == u.shape and torch.equal(t.blocks, u.blocks)):
            return False
    return True


@pytest.mark.parametrize("keep_quantized", [False, True], ids=["fp32", "as-stored"])
def test_cached_load_maps_the_file_and_equals_a_parse(tmp_path, monkeypatch, keep_quantized):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    cache = tmp_path / "cache"
    parsed = read_gguf(path, use_cache=False, keep_quantized=keep_quantized)  # the gguf package's reader
    first = read_gguf(path, cache_dir=cache, keep_quantized=keep_quantized)  # a miss: parses, stores the metadata
    assert {f.name for f in cache_entry(path, cache).iterdir()} == {
        "config.json",
        "tensors.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "manifest.json",
    }
    maps = []
    real_memmap = np.memmap

    def memmap(*args, **kwargs):
        maps.append(args[0])
        return real_memmap(*args, **kwargs)

    monkeypatch.setattr(np, "memmap", memmap)
    monkeypatch.setattr("headwise.models.gguf.open_gguf", lambda p: pytest.fail(f"parsed {p} on a cache hit"))
    hit = read_gguf(path, cache_dir=cache, keep_quantized=keep_quantized)
    assert maps == [path]  # the weights came from the file itself
    for got in (first, hit):
        assert got[0] == parsed[0] and _equal(got[1], parsed[1])
        assert got[2].encode("the cat sat") == parsed[2].encode("the cat sat")


def test_weights_are_read_from_the_file_not_a_copy(tmp_path):
    """Bytes of a tensor changed in the file (size, mtime and inode kept, so the cache key stays):
    the next load sees them, as it would not if the weights lived in the cache."""
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    cache = tmp_path / "cache"
    _, before, _ = read_gguf(path, cache_dir=cache)
    table = gguf_cache.read(cache_entry(path, cache))[1]
    name, _, dims, offset = next(t for t in table["tensors"] if t[0] == "blk.0.attn_norm.weight")  # F32
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.full(dims[0], 3.0, np.float32).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _, after, _ = read_gguf(path, cache_dir=cache)
    w = "model.layers.0.input_layernorm.weight"
    assert torch.equal(after[w], torch.full((dims[0],), 3.0)) and not torch.equal(before[w], after[w])


def test_edited_and_replaced_files_are_read_again(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    cache = tmp_path / "cache"
    old = read_gguf(path, cache_dir=cache)
    write_tiny_llama(path, seed=1, tied=True)  # rewritten in place: other weights, and no output head
    edited = read_gguf(path, cache_dir=cache)
    assert _same(edited, read_gguf(path, use_cache=False)) and not _same(edited, old)
    assert edited[0]["tie_word_embeddings"] is True and "lm_head.weight" not in edited[1]
    new = tmp_path / "new.gguf"
    write_tiny_llama(new, seed=2)
    os.replace(new, path)  # replaced by another file (another inode)
    assert _same(read_gguf(path, cache_dir=cache), read_gguf(path, use_cache=False))
    assert len(list((cache / "gguf").iterdir())) == 3  # one entry per content


def test_a_table_that_does_not_fit_the_file_is_rebuilt(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    cache = tmp_path / "cache"
    want = read_gguf(path, cache_dir=cache)
    entry = cache_entry(path, cache)
    text = (entry / "tensors.json").read_text()
    size = path.stat().st_size
    (entry / "tensors.json").write_text(text.replace(f'"size":{size}', f'"size":{size + 1}'))
    manifest = (entry / "manifest.json").read_text()
    (entry / "manifest.json").write_text(
        manifest.replace(f'"tensors.json": {len(text)}', f'"tensors.json": {len(text) + 1}')
    )
    with pytest.warns(UserWarning, match="unusable.*rebuilding"):
        assert _same(read_gguf(path, cache_dir=cache), want)


def test_smollm2_loads_with_no_copy_in_the_cache(tmp_path, monkeypatch, capsys):
    """The real 100 MB file: the cache grows by its metadata only (under 5% of the file), a load from the
    cache is the same model as the load that parsed the file (logits to the bit), and `headwise models`
    names the entry the load wrote (it said "not yet" while weights="auto" loads wrote one of their own)."""
    from headwise.cli.models import run_models
    from headwise.models import builtin

    monkeypatch.setenv("HEADWISE_CACHE", str(tmp_path))
    source = resolve("smollm2-135m-instruct")
    first = headwise.load("smollm2-135m-instruct")
    grown = _cache_bytes(tmp_path)
    assert grown < source.stat().st_size / 20, grown  # 3.5 MB of 98 MB here
    again = headwise.load("smollm2-135m-instruct")
    assert _cache_bytes(tmp_path) == grown
    ids = torch.tensor([first.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        assert torch.equal(first(ids), again(ids))
    # SmolLM2 alone: listing Gemma would join its 253 MB file into this cache first
    monkeypatch.setattr(builtin, "BUILTIN", {"smollm2-135m-instruct": builtin.BUILTIN["smollm2-135m-instruct"]})
    capsys.readouterr()
    assert run_models(None) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "parsed metadata:" in ln)
    assert str(cache_entry(source, tmp_path)) in line and "not yet" not in line
