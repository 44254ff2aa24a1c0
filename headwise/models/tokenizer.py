"""Tokenizers at the edge: text <-> ids, special tokens, and the tokenizer files they come from.

One `Tokenizer` wraps a `tokenizers.Tokenizer` built from any of:
  - a Hugging Face `tokenizer.json` (+ `tokenizer_config.json` for special tokens
    and the chat template)                          -> `Tokenizer.from_dir`
  - a BERT WordPiece `vocab.txt`                    -> `Tokenizer.from_wordpiece_vocab`
  - the vocabulary inside a GGUF (byte-level BPE, SentencePiece BPE or WordPiece;
    gguf_vocab.py builds each)                      -> `Tokenizer.from_gguf_vocab`
`save(dir)` writes the first form, so a GGUF's tokenizer can be cached and read
back without rebuilding it (Gemma's 262k: ~1 s). The engine never sees text (DESIGN: the engine speaks ids).
Chat templates render in chat_template.py, streaming detokenization is stream_decode.py
(`StreamDecoder`); byte_level.py holds the
GGUF pre-tokenizer splits and the GPT-2 byte alphabet.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from . import gguf_vocab
from .chat_template import render_chat_template

# Token texts that end a turn in common chat formats; llama.cpp treats these as
# end-of-generation too (llama-vocab.cpp, "eog" tokens).
_END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|eom_id|>",
    "</s>",
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template.

    backend: the `tokenizers.Tokenizer` doing the work; it owns normalization,
    splitting, merges, added/special tokens and the BOS/EOS post-processor.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        config: dict | None = None,
    ):
        backend.no_truncation()  # a tokenizer.json may pin truncation/padding (MiniLM: 128);
        backend.no_padding()  # callers batch and truncate themselves, as transformers does
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.config = dict(config or {})  # what `save` writes to tokenizer_config.json

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """A model directory: tokenizer.json if present, else a WordPiece vocab.txt."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is not a directory; expected a model directory with tokenizer.json or vocab.txt"
            )
        config = _read_json(path / "tokenizer_config.json")
        for name in ("special_tokens_map.json",):
            for key, value in _read_json(path / name).items():
                config.setdefault(key, value)
        if (path / "tokenizer.json").is_file():
            backend = Backend.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.txt").is_file():
            return cls.from_wordpiece_vocab(path / "vocab.txt", config=config)
        else:
            raise FileNotFoundError(f"{path} has neither tokenizer.json nor vocab.txt")
        template = config.get("chat_template")
        if isinstance(template, list):  # HF's named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template, config["chat_templates"] = named.pop("default", None), named
        if (path / "chat_template.jinja").is_file():  # transformers >= 4.49 saves it separately
            template = (path / "chat_template.jinja").read_text()
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            chat_template=template,
            model_max_length=_max_length(config),
            config=config,
        )

    @classmethod
    def from_wordpiece_vocab(cls, vocab_path: str | Path, *, config: dict | None = None) -> "Tokenizer":
        """BERT's WordPiece from vocab.txt, as transformers' BertTokenizerFast builds it.

        config: tokenizer_config.json values (do_lower_case, strip_accents,
        tokenize_chinese_chars, cls/sep/unk/pad/mask tokens); BERT defaults otherwise.
        """
        config = dict(config or {})
        lines = Path(vocab_path).read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the file ends with a newline, not an empty token
        vocab = {token: i for i, token in enumerate(lines)}
        specials = {
            k: _token_text(config.get(k)) or d
            for k, d in (
                ("unk_token", "[UNK]"),
                ("sep_token", "[SEP]"),
                ("pad_token", "[PAD]"),
                ("cls_token", "[CLS]"),
                ("mask_token", "[MASK]"),
            )
        }
        for key, token in specials.items():
            if token not in vocab:
                raise ValueError(f"{vocab_path}: {key} {token!r} is not in the vocabulary")
        backend = Backend(models.WordPiece(vocab, unk_token=specials["unk_token"], max_input_chars_per_word=100))
        backend.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=config.get("tokenize_chinese_chars", True),
            strip_accents=config.get("strip_accents"),
            lowercase=config.get("do_lower_case", True),
        )
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        cls_, sep = specials["cls_token"], specials["sep_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls_}:0 $A:0 {sep}:0",
            pair=f"{cls_}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls_, vocab[cls_]), (sep, vocab[sep])],
        )
        backend.decoder = decoders.WordPiece(prefix="##")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
        config.update(specials)
        return cls(
            backend,
            pad_token=specials["pad_token"],
            unk_token=specials["unk_token"],
            model_max_length=_max_length(config),
            config=config,
        )

    @classmethod
    def from_gguf_vocab(
        cls,
        *,
        model: str,
        tokens: Sequence[str],
        merges: Sequence[str] = (),
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        pre: str | None = None,
        arch: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        sep_id: int | None = None,
        cls_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_sep: bool | None = None,
        add_space_prefix: bool | None = None,
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        stop_ids: Sequence[int] = (),
    ) -> "Tokenizer":
        """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes (gguf_vocab.py builds it).

        model: `tokenizer.ggml.model`: "gpt2" (byte-level BPE), "llama" (SentencePiece BPE, with
        `scores`) or "bert" (WordPiece). tokens: id -> text. merges: "left right", best first (gpt2).
        token_types: llama.cpp's per-token type; 3 (CONTROL) -> special added token, 4
        (USER_DEFINED) -> added token matched whole. arch: `general.architecture` (Gemma ranks its
        SentencePiece merges by position; Phi-3 prefixes every piece with a space). add_*: the
        file's flags; None (absent) means llama.cpp's default for the model: BOS for "llama",
        [CLS] ... [SEP] for "bert", nothing for "gpt2".
        chat_templates: named ones beside the default ("tool_use"). stop_ids: end-of-turn ids the
        file names (eot, eom) beyond EOS.
        """
        types = list(token_types) if token_types is not None else []

        def text(i):
            return spelled[i] if i is not None and 0 <= i < len(tokens) else None

        if model == "gpt2":
            backend, spelled = gguf_vocab.byte_level_bpe(tokens, merges, types, pre)
        elif model == "llama":
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
            backend, spelled = gguf_vocab.sentencepiece_bpe(
                tokens,
                scores,
                types,
                unk=unk,
                add_space_prefix=True if add_space_prefix is None else add_space_prefix,
                rank_by_position=(arch or "").startswith("gemma"),
                prefix_every_piece=arch in ("phi3",),
            )
            add_bos = True if add_bos is None else add_bos
        elif model == "bert":
            backend, spelled = gguf_vocab.wordpiece(tokens, types, unk_id=unk_id)
            add_bos = True if add_bos is None else add_bos  # [CLS]
            add_sep = True if add_sep is None else add_sep  # [SEP]
            bos_id = bos_id if bos_id is not None else cls_id
        else:
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE) and 'bert' (WordPiece)"
            )
        bos, eos, sep = text(bos_id), text(eos_id), text(sep_id if sep_id is not None else eos_id)
        before = [bos] if add_bos and bos is not None else []
        after = list(dict.fromkeys(t for t, on in ((eos, add_eos), (sep, add_sep)) if on and t is not None))
        if before or after:  # llama.cpp's add_bos/add_eos/add_sep flags, baked in
            single = " ".join([f"{t}:0" for t in before] + ["$A:0"] + [f"{t}:0" for t in after])
            pair = " ".join(
                [single] + [f"{t}:1" for t in before] * (model != "bert") + ["$B:1"] + [f"{t}:1" for t in after]
            )
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in {*before, *after}]
            )
        config = {
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": text(pad_id),
            "unk_token": text(unk_id),
            "add_bos_token": bool(add_bos),
            "add_eos_token": bool(add_eos),
        }
        if model == "bert":
            config.update(sep_token=sep, cls_token=bos)
        if chat_templates:
            config["chat_templates"] = dict(chat_templates)
        if stops := [text(i) for i in stop_ids if text(i) is not None]:
            config["stop_tokens"] = stops
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=text(pad_id),
            unk_token=text(unk_id),
            chat_template=chat_template,
            config=config,
        )

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (with the chat template) into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = dict(
            self.config,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            unk_token=self.unk_token,
        )
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))

    # ---- ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Unpadded ids per text; the backend splits the work across threads."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self.unk_token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """EOS plus every special token that ends a turn (<|im_end|>, <|endoftext|>, <|eot_id|>, ...)."""
        ids = {self.eos_token_id} | {self.token_to_id(t) for t in _END_OF_TURN}
        ids = {i for i in ids if i is not None and (i in self.special_token_ids or i == self.eos_token_id)}
        named = {self.token_to_id(t) for t in self.config.get("stop_tokens", ())}  # the GGUF's eot/eom ids
        return frozenset(ids | named - {None})

    # ---- chat ----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation as the model expects it, as transformers does.

        messages: [{"role": "user", "content": "Hi"}, ...]. kwargs reach the
        template (tools=..., documents=..., any flag a template reads).
        """
        named = self.config.get("chat_templates") or {}
        if chat_template is None and kwargs.get("tools") and "tool_use" in named:
            chat_template = "tool_use"  # as transformers picks among named templates
        template = named.get(chat_template, chat_template) or self.chat_template
        if template is None:
            raise ValueError(
                "this tokenizer has no chat template (none in tokenizer_config.json or the GGUF); pass chat_template="
            )
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            **kwargs,
        }
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **context)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"pad={self.pad_token!r}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _max_length(config: dict) -> int | None:
    n = config.get("model_max_length")
    return int(n) if isinstance(n, (int, float)) and n < 1e12 else None  # HF writes 1e30 for "no limit"
