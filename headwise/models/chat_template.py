"""Chat templates: a conversation rendered as the model expects it, as transformers renders it.

The template is a model's Jinja `chat_template` (tokenizer_config.json, chat_template.jinja or the
GGUF). A GGUF is untrusted input, so the template is untrusted code. It runs in Jinja's
ImmutableSandboxedEnvironment (no `_`-prefixed attributes, so no `__class__`/`__globals__`
escapes; no mutation of lists and dicts; no loader, so no `{% import %}`/`{% include %}` of
files), sees only plain JSON-like data (`_plain`), and runs on a budget (`Limits`): every loop
item, call and attribute look-up is a step, checked against a step count and a wall-clock
deadline; sequence repetition, `**`, `%`-formatting, `+`/`~` concatenation and big integer
arguments are refused before they allocate; what a render builds in all is counted (many strings,
each under the limit, are memory too); macro calls nest at most `Limits.depth` deep; the output
stops at a size limit. A template over its budget, or failing, raises a one-line `ChatTemplateError`
naming the limit or the fault and the template's file (`TemplateText.source`, `source=`). The
helpers HF templates call are there: raise_exception, strftime_now, tojson, namespace, dict, loop
controls and `{% generation %}` blocks.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`), failed, or ran over its budget."""


class TemplateText(str):
    """A template's text that knows the file it came from (read_gguf makes the GGUF's templates so),
    so that its errors name the file wherever the text is rendered."""

    source: str | None = None

    def __new__(cls, text: str, source: str | None = None):
        self = super().__new__(cls, text)
        self.source = source
        return self


@dataclass(frozen=True)
class Limits:
    """What one render may spend. A real template renders a long conversation in a few thousand
    steps and milliseconds; these are orders of magnitude above that."""

    steps: int = 2_000_000  # loop items + calls + attribute/item look-ups
    seconds: float = 5.0
    output_chars: int = 8_000_000  # also caps any one string or list a template builds
    built_chars: int = 64_000_000  # all the strings and lists it builds, together: 8x the largest output
    depth: int = 64  # macro calls inside macro calls (a template's own recursion stays far under)
    format_chars: int = 200  # strftime_now's format: real ones are "%d %b %Y"; '%c' expands 12x
    template_chars: int = 1_000_000  # the template's own text (real ones: < 30k); compiling 1M takes ~3 s


DEFAULT_LIMITS = Limits()


def render_chat_template(
    template: str,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    source: str | None = None,
    **context: Any,
) -> str:
    """The conversation as text; context: the special tokens and whatever else the template reads
    (tools=..., documents=..., enable_thinking=...). source: the template's file, for errors
    (default: `template.source` of a TemplateText)."""
    import jinja2

    where = source or getattr(template, "source", None)
    where = f"chat template of {where}" if where else "chat template"
    data = {k: _plain(v) for k, v in context.items()}
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        if len(template) > limits.template_chars:
            raise _Refused(f"the template has {len(template)} characters, past {limits.template_chars}")
        parts, size = [], 0
        stream = _compile(template).generate(
            messages=_plain(list(messages)), add_generation_prompt=add_generation_prompt, **data
        )
        for piece in stream:
            size += len(piece)
            if size > limits.output_chars:
                raise _Refused(f"the output passed {limits.output_chars} characters")
            parts.append(piece)
        return "".join(parts)
    except _Refused as e:
        raise ChatTemplateError(f"{where} stopped: {e} (headwise.models.chat_template.Limits)") from None
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where} does not parse: {_line(e.message)} (line {e.lineno})") from None
    except jinja2.TemplateError as e:  # raise_exception's message, a sandbox refusal, an undefined name
        raise ChatTemplateError(f"{where} failed: {_line(e.message)}") from None
    except Exception as e:  # noqa: BLE001 -- untrusted code: whatever it raises is its failure, in one line
        raise ChatTemplateError(f"{where} failed: {type(e).__name__}: {_line(str(e))}") from None
    finally:
        _BUDGET.reset(token)


def template_variables(template: str) -> set[str]:
    """The names a template reads from its context (messages, tools, add_generation_prompt, ...),
    found by parsing, not running it; an empty set for a template Jinja cannot parse."""
    import jinja2
    import jinja2.meta

    if len(template) > DEFAULT_LIMITS.template_chars:
        return set()  # rendering it says why
    try:
        return set(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except (jinja2.TemplateError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return set()


def _line(message: str | None, cap: int = 300) -> str:
    """A message the template may have written (raise_exception's): one line, of bounded length."""
    text = " ".join(str(message or "").split())
    return text if len(text) <= cap else text[:cap] + f"... ({len(text)} characters)"


class _Refused(Exception):
    """The template ran over its budget (not a TemplateError, so `{% try %}`-like tricks cannot hide it)."""


class _Budget:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.steps = 0
        self.built = 0  # items of the strings and lists made so far (Limits.built_chars)
        self.depth = 0  # calls in progress (Limits.depth)
        self.deadline = time.monotonic() + limits.seconds

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.steps:
            raise _Refused(f"more than {self.limits.steps} steps (loop items, calls, look-ups)")
        if time.monotonic() > self.deadline:
            raise _Refused(f"longer than {self.limits.seconds} s")

    def size(self, value: Any) -> Any:
        """A value the template made: refused past the one-value limit, counted towards all it built."""
        if isinstance(value, (str, list, tuple, dict)):
            if len(value) > self.limits.output_chars:
                raise _Refused(f"a value of {len(value)} items passed {self.limits.output_chars}")
            self.built += len(value)
            if self.built > self.limits.built_chars:
                raise _Refused(f"the strings and lists it built passed {self.limits.built_chars} items in all")
        return value


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _budget() -> _Budget:
    return _BUDGET.get(None) or _Budget(DEFAULT_LIMITS)


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the template: objects with methods the sandbox does not know
    (a numpy array's tofile, a pydantic model's internals) become their plain form or a string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):  # pydantic (the server's request schema)
        return _plain(value.model_dump(exclude_none=True))
    return f"<{type(value).__name__}>"


_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*?(\d{5,})")  # %-widths, {:>N} widths


def _check_args(args, kwargs) -> None:
    """Refuse an integer argument that could only serve to allocate (`'x'.center(10**9)`)."""
    cap = _budget().limits.output_chars
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > cap:
            raise _Refused(f"an argument of {a} passed {cap}")
        if isinstance(a, str) and len(a) > cap:
            raise _Refused(f"a string argument of {len(a)} characters passed {cap}")


def _check_growth(name: str, value: Any, args: tuple) -> None:
    """Refuse a replace or join whose result would pass the output limit, before it is built:
    each input may be under the limit while the product of two is not."""
    cap = _budget().limits.output_chars
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        size = len(value) + (value.count(old) if old else len(value) + 1) * max(0, len(new) - len(old))
    elif name == "join" and isinstance(value, str) and args and isinstance(args[0], list):  # sep.join(items)
        size = len(value) * max(0, len(args[0]) - 1) + sum(len(x) for x in args[0] if isinstance(x, str))
    elif name == "join" and isinstance(value, list):  # items | join(sep)
        size = len(str(args[0]) if args else "") * max(0, len(value) - 1) + sum(len(str(x)) for x in value)
    elif name == "indent" and isinstance(value, str):
        width = args[0] if args and isinstance(args[0], int) else len(str(args[0])) if args else 4
        size = len(value) + (value.count("\n") + 1) * width
    elif name in ("format", "format_map") and isinstance(value, str):  # '{:>1000000000}' or '%1000000000d'
        size = sum(int(g) for m in _FORMAT_WIDTH.finditer(value) for g in m.groups() if g)
    else:
        return
    if size > cap:
        raise _Refused(f"{name} would build {size} characters, past {cap}")


_COMPILED: dict[str, Any] = {}


def _compile(template: str):
    if template not in _COMPILED:
        if len(_COMPILED) > 64:  # a server sees a handful of templates; a caller passing many is bounded
            _COMPILED.clear()
        _COMPILED[template] = _environment().from_string(template)
    return _COMPILED[template]


@functools.cache
def _environment():
    """One sandboxed environment with transformers' chat-template settings and our budget hooks."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (marks the assistant's tokens for
        training masks); rendering only needs the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def _parse(self, source, name, filename):
            # every `{% for %}` iterates through the budget: an empty nested loop costs steps too
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, "_budgeted", [], [], None, None, lineno=loop.lineno)
            # and every `a ~ b ~ c` is sized before it is joined (Jinja joins Concat nodes in place)
            for concat in list(tree.find_all(nodes.Concat)):
                parts = nodes.List(concat.nodes, lineno=concat.lineno)
                concat.nodes = [nodes.Filter(parts, "_concat", [], [], None, None, lineno=concat.lineno)]
            return tree

        def unsafe_undefined(self, obj, attribute):
            # Jinja answers an unsafe attribute with an Undefined that renders as ""; fail loudly instead
            raise jinja2.exceptions.SecurityError(
                f"chat template reached for {type(obj).__name__}.{attribute}, which the sandbox forbids"
            )

        def call(self, __context, __obj, *args, **kwargs):
            b = _budget()
            b.step()
            _check_args(args, kwargs)
            target = getattr(__obj, "__wrapped__", __obj)  # Jinja wraps str.format for its own checks
            owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
            if isinstance(owner, str) and name in ("replace", "join", "format", "format_map"):
                if name == "join" and args and not isinstance(args[0], str):
                    args = (list(b.size(list(args[0]))), *args[1:])  # sized before the join
                _check_growth(name, owner, args)
            b.depth += 1
            try:
                if b.depth > b.limits.depth:
                    raise _Refused(f"calls nested more than {b.limits.depth} deep (a macro calling itself?)")
                return b.size(super().call(__context, __obj, *args, **kwargs))
            finally:
                b.depth -= 1

        def getattr(self, obj, attribute):
            _budget().step()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _budget().step()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            cap = _budget().limits.output_chars
            if operator == "+":
                sized = (str, list, tuple)
                if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > cap:
                    raise _Refused(f"adding {len(left)} and {len(right)} items passes {cap}")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > cap:
                    raise _Refused(f"repeating {len(seq)} items {n} times passes {cap}")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(right) * abs(left).bit_length() > 1 << 16:
                    raise _Refused(f"{left} ** {right} is too large")
            elif operator == "%" and isinstance(left, str):
                for m in _FORMAT_WIDTH.finditer(left):
                    if any(g and int(g) > cap for g in m.groups()):
                        raise _Refused(f"a format width in {left[:40]!r} passes {cap}")
            return _budget().size(self.binop_table[operator](left, right))

    class NoFiles(jinja2.BaseLoader):
        def get_source(self, environment, template):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not import, include or extend other templates ({template!r})"
            )

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], loader=NoFiles())

    def concat(parts):  # `a ~ b`: each part as Jinja makes it (str), their sum checked before the join
        texts = [p if isinstance(p, str) else _budget().size(str(p)) for p in parts]
        total = sum(len(t) for t in texts)
        if total > _budget().limits.output_chars:
            raise _Refused(f"joining {total} characters with ~ passes {_budget().limits.output_chars}")
        return _budget().size("".join(texts))

    def strftime_now(fmt):
        fmt = str(fmt)
        if len(fmt) > _budget().limits.format_chars:
            raise _Refused(f"strftime_now's format has {len(fmt)} characters, past {_budget().limits.format_chars}")
        return datetime.now().strftime(fmt)

    def budgeted(iterable):
        b = _budget()
        for item in iterable:
            b.step()
            yield item

    def guard(name, f):  # a filter with its arguments checked and its result sized
        @functools.wraps(f)
        def guarded(*args, **kwargs):
            _budget().step()
            skip = 1 if getattr(f, "jinja_pass_arg", None) else 0  # the context/environment argument
            _check_args(args[skip:], kwargs)
            if name in ("replace", "join", "indent", "format") and len(args) > skip:
                value = args[skip]
                if name == "join" and not isinstance(value, str):
                    value = _budget().size(list(value))
                    args = (*args[:skip], value, *args[skip + 1 :])
                _check_growth(name, value, tuple(args[skip + 1 :]) + tuple(kwargs.values()))
            return _budget().size(f(*args, **kwargs))

        return guarded

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not Jinja's own: that one escapes HTML characters (<, >, &, '), which templates do not want
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)`, refusing `_`-prefixed names (as transformers' TemplateNamespace)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace._check(key)
            _budget().size(value)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {key!r}")

    def plain_dict(*args, **kwargs):
        return dict(*args, **kwargs)

    env.filters = {name: guard(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = guard("tojson", tojson)
    env.filters["_budgeted"] = budgeted
    env.filters["_concat"] = concat
    env.globals.pop("lipsum", None)  # generates text in a loop no template needs
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace, dict=plain_dict)
    return env
