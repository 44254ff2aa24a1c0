"""Every family's GGUF fixture, written by llama.cpp's own converter (tests/fixtures/families/make.py),
tokenizes as the Hugging Face tokenizer it was converted from, and as transformers' reading of the
GGUF where transformers reads one (it has no BERT GGUF support): byte-level BPE for the decoders,
WordPiece in llama.cpp's "▁word" spelling for BERT, with the file's add_bos/add_eos flags."""

from pathlib import Path

import pytest

from headwise.models.gguf import open_gguf
from headwise.models.gguf_meta import gguf_tokenizer, read_metadata

from .test_tokenizer import BERT_TEXTS
from .test_tokenizer_gguf import TEXTS

FIXTURES = Path(__file__).parent.parent / "fixtures" / "families"
FILES = sorted(p.name for p in FIXTURES.glob("*.gguf"))


def test_there_are_fixtures():
    assert {"bert.gguf", "gemma3.gguf", "qwen2.gguf", "phi3.gguf", "gpt2.gguf"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_converter_made_gguf_tokenizes_as_its_source(name):
    from transformers import AutoTokenizer

    path = FIXTURES / name
    reader = open_gguf(path)
    ours = gguf_tokenizer(reader, read_metadata(reader), path)
    family = name.split(".")[0]
    references = [AutoTokenizer.from_pretrained(FIXTURES / family)]  # the tokenizer the file was made from
    if family != "bert":
        references.append(AutoTokenizer.from_pretrained(FIXTURES, gguf_file=name))
    texts = TEXTS + (BERT_TEXTS if family == "bert" else [])
    for hf in references:
        for text in texts:
            for special in (True, False):
                assert (
                    ours.encode(text, add_special_tokens=special) == hf(text, add_special_tokens=special).input_ids
                ), (text, special)
            ids = ours.encode(text)
            assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    if family == "bert":
        ids = ours.encode("hello world")
        assert ours.id_to_token(ids[0]) == "[CLS]" and ours.id_to_token(ids[-1]) == "[SEP]"
