"""Grammar-constrained decoding (headwise/runtime/grammar.py) against an independent judge: every
constrained greedy answer of SmolLM2 must validate with `jsonschema` (or match the regex), at batch 1
through generate() and with 16 different schemas at once through the Engine."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import jsonschema
import pytest
import torch

from headwise.engine import Engine
from headwise.generation.generate import generate
from headwise.runtime import grammar
from headwise.runtime.grammar import grammar_processor
from headwise.runtime.sampling import SamplingParams

SCHEMAS = json.loads((Path(__file__).parents[1] / "fixtures" / "schemas" / "schemas.json").read_text())
MAX_TOKENS = 64  # the fixture schemas are bounded (maxLength, maxItems, patterns): their answers fit


def schema_format(item) -> dict:
    return {"type": "json_schema", "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True}}


def messages(item) -> list[dict]:
    return [{"role": "user", "content": item["prompt"]}]


def constrained(model, fmt, max_new_tokens=MAX_TOKENS) -> SamplingParams:
    proc = grammar_processor(model.tokenizer, fmt, vocab_size=model.config.vocab_size)
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, logits_processors=(proc,))


def check(item, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", f"{item['name']}: cut at max_tokens: {text!r}"
    jsonschema.validate(json.loads(text), item["schema"])


def test_fixture_set_covers_the_features():
    assert len(SCHEMAS) >= 30
    blob = json.dumps([s["schema"] for s in SCHEMAS])
    for feature in ('"$ref"', '"anyOf"', '"enum"', '"minItems"', '"maxItems"', '"minimum"', '"null"', '"pattern"'):
        assert feature in blob, feature
    assert any(
        "required" in s["schema"] and len(s["schema"]["required"]) < len(s["schema"]["properties"])
        for s in SCHEMAS
        if "properties" in s["schema"]
    )  # an optional field


def test_every_schema_at_batch_1_through_generate(smollm2_fp32):
    bad = []
    for item in SCHEMAS:
        r = generate(smollm2_fp32, messages(item), constrained(smollm2_fp32, schema_format(item)))
        try:
            check(item, r.text, r.finish_reason)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{item['name']}: {r.text!r}: {str(e).splitlines()[0]}")
    assert not bad, "\n".join(bad)


def test_16_different_schemas_at_once_through_the_engine(smollm2_fp32):
    items = SCHEMAS[:16]
    engine = Engine(smollm2_fp32, max_num_seqs=16, num_blocks=256, block_size=16)
    outs = engine.generate([messages(i) for i in items], [constrained(smollm2_fp32, schema_format(i)) for i in items])
    for item, out in zip(items, outs):
        check(item, out.outputs[0].text, out.outputs[0].finish_reason)
    alone = generate(smollm2_fp32, messages(items[5]), constrained(smollm2_fp32, schema_format(items[5])))
    assert outs[5].outputs[0].text == alone.text  # the mask of a row does not depend on its batch


def test_json_object_and_regex(smollm2_fp32):
    r = generate(
        smollm2_fp32,
        [{"role": "user", "content": "Describe a cat as JSON."}],
        constrained(smollm2_fp32, {"type": "json_object"}, 48),
    )
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    else:  # cut by max_tokens: still an object's prefix
        assert r.text.startswith("{")
    pattern = r"(yes|no), [0-9]{2}"
    r = generate(
        smollm2_fp32, "Is the sky blue? Answer:", constrained(smollm2_fp32, {"type": "regex", "pattern": pattern})
    )
    assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


class Req:
    def __init__(self, output_token_ids):
        self.output_token_ids = output_token_ids


def test_eos_is_legal_only_where_the_grammar_is_complete(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    proc = grammar_processor(tok, {"type": "regex", "pattern": "ab+"})
    (eos,) = grammar.stop_token_ids(tok)[:1]
    V = smollm2_fp32.config.vocab_size
    a = tok.backend.encode("a", add_special_tokens=False).ids
    ab = tok.backend.encode("ab", add_special_tokens=False).ids
    r_empty, r_a, r_ab = (Req(ids) for ids in ([], a, ab))
    masked = proc(torch.zeros(3, V), [r_empty, r_a, r_ab])
    assert masked[0, eos] == -float("inf") and masked[1, eos] == -float("inf")  # "", "a": not yet
    assert masked[2, eos] == 0  # "ab" is complete (and may go on)
    assert masked[0, a[0]] == 0 and (masked[0] == 0).sum() < V // 100  # "a" is legal first, few others are


def test_grammars_are_cached(smollm2_fp32):
    tok, item = smollm2_fp32.tokenizer, SCHEMAS[0]
    assert grammar_processor(tok, schema_format(item)) is grammar_processor(tok, schema_format(item))
    assert grammar_processor(tok, schema_format(item)) is not grammar_processor(tok, schema_format(SCHEMAS[1]))


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ],
)
def test_an_unsupported_feature_is_an_error_naming_it(smollm2_fp32, schema, named):
    with pytest.raises(ValueError, match=f'unsupported JSON schema: .*"{named}"'):
        grammar_processor(smollm2_fp32.tokenizer, {"type": "json_schema", "json_schema": {"schema": schema}})


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, 'needs a "schema"'),
        ({"type": "regex", "pattern": ""}, "non-empty pattern"),
        ({"type": "regex", "pattern": "(unclosed"}, "unsupported regex"),
        ({"type": "yaml"}, "has no grammar"),
    ],
)
def test_bad_formats_say_what_is_wrong(smollm2_fp32, fmt, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        grammar_processor(smollm2_fp32.tokenizer, fmt)


def test_without_llguidance_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=re.escape("pip install headwise[structured]")):
        grammar.compile_grammar("json_object", None)


def test_sampled_completions_each_follow_the_grammar(smollm2_fp32):
    """n > 1 sampled completions share the processor, each with its own matcher (its own tokens)."""
    item = next(s for s in SCHEMAS if s["name"] == "weather")
    params = dataclasses.replace(constrained(smollm2_fp32, schema_format(item)), temperature=1.0, seed=0, n=3)
    results = generate(smollm2_fp32, messages(item), params)
    assert len({r.text for r in results}) > 1  # sampled: they differ
    for r in results:
        check(item, r.text, r.finish_reason)


def test_masks_computed_during_the_forward_are_the_masks(smollm2_fp32, monkeypatch):
    """The core starts each grammar's next masks after a step (prefetch); the masks used are those a
    call computes itself: same constrained outputs as with prefetching off, and the prefetched
    masks were the ones used (a changed batch falls back to computing)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a core left over: the core prefetches
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # and no other process busy on it (the thread governor's reading of a loaded test machine)
    monkeypatch.setattr("headwise.runtime.core.GOVERNOR", types.SimpleNamespace(others=0.0))
    items = SCHEMAS[:4]
    fmts = [schema_format(item) for item in items]
    proc_type = grammar.GrammarProcessor
    used, calls = [0], [0]
    inner_call = proc_type.__call__

    def counting(self, logits, requests):
        calls[0] += 1
        used[0] += self._ahead is not None
        return inner_call(self, logits, requests)

    def run(prefetch: bool):
        engine = Engine(smollm2_fp32, max_num_seqs=4, num_blocks=64, block_size=16)
        saved = proc_type.prefetch
        if not prefetch:
            proc_type.prefetch = lambda self, requests: None
        proc_type.__call__ = counting
        try:
            outs = engine.generate([messages(i) for i in items], [constrained(smollm2_fp32, f, 24) for f in fmts])
        finally:
            proc_type.prefetch, proc_type.__call__ = saved, inner_call
        return [o.outputs[0].token_ids for o in outs]

    plain = run(prefetch=False)
    assert used[0] == 0
    calls[0] = 0
    assert run(prefetch=True) == plain
    assert used[0] > calls[0] / 2  # most steps found their masks ready
    # a prefetch for another batch is not used for this one; either way the masks are the call's own
    V = smollm2_fp32.config.vocab_size
    proc = grammar_processor(smollm2_fp32.tokenizer, fmts[0], vocab_size=V)

    class Req:  # what a processor reads of a request
        def __init__(self, out):
            self.output_token_ids = out

    r1, r2 = Req([]), Req(smollm2_fp32.tokenizer.encode('{"', add_special_tokens=False))
    want = proc(torch.zeros(2, V), [r1, r2])
    assert not torch.equal(want[0], want[1]) and torch.isinf(want).any()
    proc.prefetch([r1])
    assert torch.equal(proc(torch.zeros(2, V), [r1, r2]), want)  # r2 was not prefetched: computed
    proc.prefetch([r2, r1])
    assert torch.equal(proc(torch.zeros(2, V), [r1, r2]), want)  # prefetched in another order


def test_several_grammars_mask_in_one_call_as_each_alone(smollm2_fp32):
    """The sampler hands every grammar of a step to llguidance in one call (grammar.banned_many):
    each row's mask is the mask its own processor computes alone."""
    V = smollm2_fp32.config.vocab_size
    procs = [grammar_processor(smollm2_fp32.tokenizer, schema_format(item), vocab_size=V) for item in SCHEMAS[:3]]
    assert len({p.batch_key for p in procs}) == 1

    class Req:
        def __init__(self, out):
            self.output_token_ids = out

    enc = smollm2_fp32.tokenizer.encode
    groups = [(procs[0], [Req([]), Req(enc('{"', add_special_tokens=False))]), (procs[1], [Req([])]), (procs[2], [])]
    together = grammar.banned_many(groups, V)
    alone = [p(torch.zeros(len(reqs), V), reqs) == float("-inf") for p, reqs in groups]
    assert [m.shape for m in together] == [(2, V), (1, V), (0, V)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert not torch.equal(together[0][0], together[0][1])
