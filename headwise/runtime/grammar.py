"""Grammar-constrained decoding: a `LogitsProcessor` that masks every token the grammar (a JSON
schema, any JSON object, a regex) cannot take next, with llguidance (docs/structured-outputs.md
says why llguidance and not xgrammar).

    proc = grammar_processor(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    params = SamplingParams(temperature=0, logits_processors=(proc,))

One processor per grammar (cached, bounded LRU): the requests carrying the same grammar share it,
so the sampler calls it once per step for all of them and their masks are computed together, in
parallel, by llguidance's executor. Each request gets its own matcher, advanced with the tokens it
actually sampled (`output_token_ids`); EOS is legal only where the grammar is complete. A schema
feature llguidance does not implement is a ValueError naming it, never silently dropped.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

INSTALL_HINT = "grammar-constrained decoding needs llguidance: pip install headwise[structured]"
CACHE_SIZE = 128  # compiled grammars kept per process (a schema compiles in ~0.3 ms; the LLTokenizer is shared)
# Compact JSON, no free whitespace: a greedy small model otherwise pads with newlines until max_tokens,
# and each token of whitespace is a step paid for.
JSON_OPTIONS = {"whitespace_flexible": False}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # an optional dependency: say which extra brings it
        raise ImportError(INSTALL_HINT) from e
    return llguidance


# One thread computes the masks of the next step while the model runs (GrammarProcessor.prefetch)
_AHEAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="headwise-mask")
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_cache: OrderedDict = OrderedDict()
_lock = threading.Lock()


def stop_token_ids(tok) -> list[int]:
    """The ids that end a sequence for this tokenizer (its end-of-turn and EOS tokens), as the
    runtime's finish rule reads them."""
    ids = getattr(tok, "stop_token_ids", None) or [tok.eos_token_id]
    return sorted(int(i) for i in ids if i is not None)


def llg_tokenizer(tok, vocab_size: int | None = None):
    """The llguidance tokenizer of a headwise Tokenizer (built once, ~0.2 s for 49k tokens); EOS is the
    tokenizer's stop ids, so the mask lets them through exactly where the grammar may end."""
    key = (vocab_size,)
    with _lock:
        per = _tokenizers.setdefault(tok, {})
        if key not in per:
            per[key] = _llg().LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=stop_token_ids(tok))
        return per[key]


def compile_grammar(kind: str, spec) -> str:
    """(kind, spec) -> llguidance's grammar text. kind: "json_schema" (spec a dict or JSON text),
    "json_object" (spec ignored: any JSON object), "regex" (spec the pattern)."""
    llg = _llg()
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(spec).__name__}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"unsupported JSON schema: {e}") from None
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a regex grammar needs a non-empty pattern string")
        return llg.LLMatcher.grammar_from_regex(spec)
    raise ValueError(f"unknown grammar kind {kind!r}; expected one of json_schema, json_object, regex")


def grammar_processor(tok, response_format: dict, *, vocab_size: int | None = None) -> "GrammarProcessor":
    """An OpenAI-style response_format -> its processor (cached per tokenizer and grammar):
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}},
    and ours, {"type": "regex", "pattern": ...}. ValueError names what is wrong or unsupported."""
    kind = response_format.get("type")
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        if "schema" not in js:
            raise ValueError('json_schema needs a "schema" (the JSON Schema the output must match)')
        spec = json.dumps(js["schema"])  # key order kept: it is the order of the output's properties
    elif kind == "regex":
        spec = response_format.get("pattern")
    elif kind == "json_object":
        spec = ""
    else:
        raise ValueError(f"response_format type {kind!r} has no grammar; expected json_object, json_schema or regex")
    what = "regex" if kind == "regex" else "JSON schema"
    return _cached(tok, vocab_size, (kind, spec), lambda: compile_grammar(kind, spec), what)


def lark_processor(tok, lark: str, *, vocab_size: int | None = None, what: str = "grammar") -> "GrammarProcessor":
    """A Lark grammar in llguidance's dialect (runtime/tool_grammar.py writes them) -> its processor,
    cached as grammar_processor's. ValueError names what llguidance cannot compile."""
    llg = _llg()

    def build():
        try:
            return llg.LLMatcher.grammar_from_lark(lark)
        except ValueError as e:
            raise ValueError(f"unsupported {what}: {_first_line(str(e))}") from None

    return _cached(tok, vocab_size, ("lark", lark), build, what)


def schema_error(tok, schema, *, vocab_size: int | None = None) -> str | None:
    """Why llguidance cannot enforce this JSON schema (a feature it lacks, a malformed schema), or None."""
    llg = _llg()
    try:
        grammar = compile_grammar("json_schema", schema)
    except ValueError as e:
        return str(e)
    err = llg.LLMatcher.validate_grammar(grammar, llg_tokenizer(tok, vocab_size))
    if not err or err.startswith("WARNING"):
        return None
    return " ".join(line.strip() for line in err.strip().splitlines() if line.strip())[:400]


def _cached(tok, vocab_size, spec: tuple, build, what: str) -> "GrammarProcessor":
    key = (id(tok), vocab_size, *spec)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit.tok_ref() is tok:
            _cache.move_to_end(key)
            return hit
    proc = GrammarProcessor(tok, build(), vocab_size=vocab_size, what=what)
    with _lock:
        _cache[key] = proc
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return proc


class GrammarProcessor:
    """The mask of one grammar for every request carrying it. Per-request state: one llguidance
    matcher per request object (a weak reference: it goes with the request) and how many of the
    request's output tokens it has consumed."""

    def __init__(self, tok, grammar: str, *, vocab_size: int | None = None, what: str = "grammar"):
        llg = _llg()
        self.tok_ref = weakref.ref(tok)
        self.grammar, self.what = grammar, what
        self.llg_tok = llg_tokenizer(tok, vocab_size)
        err = llg.LLMatcher.validate_grammar(grammar, self.llg_tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(f"unsupported {what}: {_first_line(err)}")
        self._matchers: dict[int, tuple] = {}  # id(request) -> (weakref to request, matcher, consumed)
        self._executor = llg.LLExecutor()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size  # the model's (the logits' width), when known
        self._ahead = None  # (keys, requests, future) of prefetch()

    def new_matcher(self):
        m = _llg().LLMatcher(self.llg_tok, self.grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"unsupported {self.what}: {_first_line(m.get_error())}")
        return m

    def _matcher(self, req):
        """The request's matcher, advanced over the output tokens it has not consumed yet."""
        out = list(req.output_token_ids)
        entry = self._matchers.get(id(req))
        if entry is None or entry[0]() is not req or entry[2] > len(out):  # new (or rewound) request
            try:
                ref = weakref.ref(req)
            except TypeError:  # a tuple (sampler.Row): no state to keep, replay its tokens each call
                ref = None
            entry = (ref, self.new_matcher(), 0)
        ref, m, done = entry
        if done < len(out):
            m.consume_tokens(out[done:])  # a token the mask forbade leaves m in its error state
        if ref is not None:
            self._matchers[id(req)] = (ref, m, len(out))
        return m

    def prefetch(self, requests: Sequence) -> None:
        """Start computing these requests' next masks (each has just taken a token) on a thread of
        its own, so that they are ready when the next step's forward ends (the core calls this after
        a step; llguidance works without the GIL). The next call uses them for the requests whose
        output has not moved since; otherwise it computes its masks itself."""
        reqs = list(requests)  # held until used: ids stay unique
        keys = {(id(r), len(r.output_token_ids)): j for j, r in enumerate(reqs)}
        self._ahead = (keys, reqs, _AHEAD.submit(self._banned, reqs, self.vocab_size))

    def __call__(self, logits: Tensor, requests: Sequence) -> Tensor:
        """logits (R, V), requests[i] owns row i -> logits with every token the grammar forbids at -inf."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            keys, _, job = ahead
            rows = [keys.get((id(r), len(r.output_token_ids))) for r in requests]
            if None not in rows:  # every mask was computed during the forward
                banned = job.result()
                banned = banned if rows == list(range(len(banned))) else banned[rows]
                return logits.masked_fill_(self._pad(banned, logits.shape[1]), float("-inf"))
            job.result()  # not for this call (the batch changed): let it finish with the matchers
        return logits.masked_fill_(self._banned(requests, logits.shape[1]), float("-inf"))

    @staticmethod
    def _pad(banned: Tensor, V: int) -> Tensor:
        if banned.shape[1] < V:  # rows of the model's padded vocabulary past the tokenizer's: never legal
            banned = torch.nn.functional.pad(banned, (0, V - banned.shape[1]), value=True)
        return banned[:, :V]

    def _banned(self, requests: Sequence, V: int | None) -> Tensor:
        """(R, V) bool: True where requests[i]'s grammar forbids the token next."""
        return banned_many([(self, requests)], V)[0]

    @property
    def batch_key(self) -> tuple:
        """Processors with equal keys mask together (`banned_many`): grammars over one tokenizer."""
        return ("llguidance", id(self.llg_tok))

    def _drop_finished(self) -> None:
        dead = [k for k, (ref, _, _) in self._matchers.items() if ref() is None]
        for k in dead:
            del self._matchers[k]

    def is_complete(self, req) -> bool:
        """Whether the request's output so far is a complete match of the grammar."""
        with self._lock:
            m = self._matcher(req)
            return m.is_accepting() or m.is_stopped()


def _first_line(msg: str) -> str:
    return msg.strip().splitlines()[0] if msg.strip() else msg


def banned_many(groups: Sequence[tuple], V: int | None) -> list[Tensor]:
    """[(GrammarProcessor, requests)] of processors over one tokenizer (equal `batch_key`) -> for each,
    (len(requests), V) bool, True where that grammar forbids the token next: every mask of every
    grammar in ONE llguidance executor call (across its threads), where a call per grammar was a
    call per grammar per step (16 schemas in a batch: 16 calls)."""
    procs = list({id(p): p for p, _ in groups}.values())
    first = procs[0]
    V = V or first.llg_tok.vocab_size
    sizes = [len(reqs) for _, reqs in groups]
    R, words = sum(sizes), (first.llg_tok.vocab_size + 31) // 32
    locks = [p._lock for p in sorted(procs, key=id)]  # one order, so two callers never deadlock
    for lock in locks:
        lock.acquire()
    try:
        ms = []
        for p in procs:
            p._drop_finished()
        for p, reqs in groups:
            ms += [p._matcher(r) for r in reqs]
        bits = torch.zeros(R, words, dtype=torch.int32)  # (R, V/32): bit t of the row = token t allowed
        live = [(m, i) for i, m in enumerate(ms) if not m.is_error()]
        if len(live) == 1:
            m, i = live[0]
            m.unsafe_compute_mask_ptr(bits[i].data_ptr(), words * 4)
        elif live:  # every request's mask at once, across llguidance's threads
            first._executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), words * 4, R)
    finally:
        for lock in locks:
            lock.release()
    for m in ms:
        if m.is_error():  # the request took a token outside the grammar (cannot happen through the mask)
            raise ValueError(f"the output left the grammar: {_first_line(m.get_error())}")
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")  # (R, words*32) 0/1
    banned = GrammarProcessor._pad(torch.from_numpy(allowed[:, :V]) == 0, V)  # one pass: uint8 -> bool
    return list(banned.split(sizes))
