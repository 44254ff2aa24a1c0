"""Tool calls as a grammar: the text formats models are trained to call functions in, and the
llguidance Lark grammar that makes a call parse and match its tool's parameters schema
(docs/tools.md).

    fmt = HERMES                                   # <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>
    lark = tool_grammar(fmt, [("get_weather", schema)], choice="required", parallel=False)
    proc = lark_processor(tok, lark)               # runtime/grammar.py

A call is `open + name + mid + arguments + close`: the name is one of the tools' (an alternative per
tool, so each name carries its own arguments schema), the arguments a `%json{...}` of that schema.
"required" is calls only (a named tool: "required" over that one); "auto" is free text, and once the text reaches the
format's trigger (`<tool_call>`; for Llama 3.x's bare JSON, a `{` that opens the answer) the rest is
the call. `parallel` allows several calls (separated by `sep`), else exactly one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CallFormat:
    """One tool-call text format; `open + name + mid + ARGUMENTS + close`, calls joined by `sep`."""

    name: str
    open: str
    mid: str
    close: str
    sep: str
    anywhere: bool  # a call may follow text (a trigger); False: the answer is calls or text, never both
    parallel: bool = True  # the format can hold several calls in one turn


# Qwen 2.5/3, Hermes 2/3 and our own preamble (models without a tool template): NousResearch's format
HERMES = CallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", anywhere=True)
# Llama 3.1-3.3's JSON tool calling (their templates ask for exactly this; one call per turn)
LLAMA3 = CallFormat("llama3", '{"name": "', '", "parameters": ', "}", "", anywhere=False, parallel=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3)}

# arguments as compact JSON (no free whitespace: a small greedy model pads with newlines otherwise)
JSON_OPTIONS = {"whitespace_flexible": False}


def _lit(s: str) -> str:
    return json.dumps(s)  # a Lark string literal has JSON's escapes


def _seq(s: str, special: frozenset[str]) -> str:
    """Text as a Lark sequence: literals, and special tokens by name (`<tool_call>` where the
    tokenizer has it as one special token: its bytes alone never match a special token)."""
    if not special:
        return _lit(s)
    parts = re.split("(" + "|".join(re.escape(t) for t in sorted(special)) + ")", s)
    return " ".join(p if p in special else _lit(p) for p in parts if p)


def arguments_schema(parameters: dict | None) -> dict:
    """A tool's parameters as the arguments' schema; none given means no arguments: `{}` (as OpenAI).
    An object schema that lists properties and says nothing of others gets none (as OpenAI's strict
    mode): a small model otherwise invents keys no tool reads. The answer still matches the schema."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return _closed(parameters)


_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _closed(schema):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _closed(out[k])
    for k in _MANY:
        if isinstance(out.get(k), list):
            out[k] = [_closed(s) for s in out[k]]
    for k in _NAMED:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(s) for name, s in out[k].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(out["additionalProperties"])
    elif "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(
    fmt: CallFormat,
    tools: list[tuple[str, dict | None]],
    *,
    choice: str,
    parallel: bool,
    text: str | None = None,
    special: frozenset[str] = frozenset(),
) -> str:
    """The Lark grammar of an answer. tools: (name, parameters schema) pairs, the ones that may be
    called (one, for OpenAI's named tool_choice); choice: "auto" (text or calls) or "required"
    (calls only). text: a Lark
    expression auto's text must match (a response_format's `%json {...}`), else any text.
    special: the format's markers that are special tokens of the tokenizer (written as tokens)."""
    if choice not in ("auto", "required") or not tools:
        raise ValueError(f"a tool grammar needs tools and a choice of auto or required, got {choice!r}")
    lines = ["%llguidance {}"]
    alts = []
    for i, (name, params) in enumerate(tools):
        schema = {**arguments_schema(params)}
        if isinstance(schema, dict):
            schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
        lines.append(f"call_{i}: {_lit(name + fmt.mid)} %json {json.dumps(schema)} {_seq(fmt.close, special)}")
        alts.append(f"call_{i}")
    lines.append("body: " + " | ".join(alts))
    many = parallel and fmt.parallel
    opening = _seq(fmt.open, special)
    rest = f" ({_seq(fmt.sep + fmt.open, special)} body)*" if many else ""
    if choice != "auto":
        lines.append(f"start: {opening} body{rest}")
    elif text is not None:  # a structured answer or calls
        lines.append(f"start: {text} | {opening} body{rest}")
    elif fmt.anywhere:  # text, or text up to the first trigger and then calls (llguidance's lazy lexeme)
        # a special-token trigger never occurs in TEXT, so it needs no laziness (llguidance's StructTag)
        lazy = "" if opening.startswith("<") else "[lazy]"
        lines += [f"start: TEXT | trigger body{rest}", f"trigger{lazy}: TEXT {opening}", r"TEXT: /(.|\n)*/"]
    else:  # text that does not begin the way a call does, or a call
        first = fmt.open[0]
        lines += [f"start: PLAIN | {opening} body{rest}", f"PLAIN: /([^{_regex_char(first)}](.|\\n)*)?/"]
    return "\n".join(lines) + "\n"


def _regex_char(c: str) -> str:
    return "\\" + c if c in r"\^-[]{}()/.*+?|$" else c
