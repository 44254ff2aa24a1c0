"""Tool calling on /v1/chat/completions (docs/tools.md): a request's tools, tool_choice and
parallel_tool_calls checked and planned, the conversation rendered with them, and the grammar that
makes each call parse and match its tool's parameters. Reading the calls back out of the generated
text: tool_calls.py.

Where the model's chat template renders `tools` itself in a format we know (Qwen / Hermes
`<tool_call>`, Llama 3.x JSON), tools, assistant tool_calls and role "tool" results go through the
template as transformers' apply_chat_template passes them. Otherwise (SmolLM2, templates in another
format) a system preamble of ours lists the tools and the Hermes format, and calls and results
become plain turns any template renders.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from ...runtime.tool_grammar import HERMES, LLAMA3, CallFormat, arguments_schema, tool_grammar
from ..errors import APIError
from ..schemas import ChatCompletionRequest

PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this model: the call format, the tools (name, parameters
    schema), the choice ("none", "auto" or "required"; `named`: required, of that tool), several calls or one, and
    whether the template renders the tools itself (native) or our preamble does."""

    fmt: CallFormat
    tools: tuple[tuple[str, dict | None], ...]
    specs: tuple[dict, ...]  # the tools as OpenAI's JSON ({"type": "function", "function": {...}})
    choice: str
    named: str | None  # tool_choice {"type": "function", "function": {"name": ...}}
    parallel: bool
    native: bool

    @property
    def calls(self) -> bool:
        """Whether the answer may hold calls (tool_choice "none": tools described, never called)."""
        return self.choice != "none"


def _bad(message: str, param: str, code: str = "invalid_tools") -> APIError:
    return APIError(400, message, param=param, code=code)


def tool_template(tok) -> str | None:
    """The template apply_chat_template uses when tools are passed (a named "tool_use" one first)."""
    return (tok.config.get("chat_templates") or {}).get("tool_use") or tok.chat_template


def template_format(template: str | None) -> CallFormat | None:
    """The call format a template renders tools in, or None: it does not render `tools`, or in a
    format we do not parse (then our preamble describes the tools)."""
    if not template:
        return None
    from ...models.chat_template import template_variables

    if "tools" not in template_variables(template):
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3
    return None


def plan(tok, req: ChatCompletionRequest, *, runtime=None) -> ToolPlan | None:
    """The request's tools checked (400s name the field) and planned; None: no tools in play.
    runtime: also check that the grammar library can enforce each parameters schema."""
    choice = req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if not req.tools:
        if named is not None or choice == "required":
            raise _bad(f"tool_choice {named or choice!r} needs tools; send the functions in `tools`", "tool_choice")
        _check_messages(req)
        return None
    if tok is None:
        raise _bad(f"model {req.model!r} has no tokenizer, which tool calling needs", "tools")
    seen: dict[str, int] = {}
    for i, t in enumerate(req.tools):
        name = t.function.name
        if name in seen:
            raise _bad(
                f"tools[{i}].function.name {name!r} is also tools[{seen[name]}]'s; names must be unique", "tools"
            )
        seen[name] = i
        if runtime is not None:
            _check_schema(runtime, t.function.parameters, f"tools[{i}].function.parameters", name)
    if named is not None and named not in seen:
        raise _bad(
            f"tool_choice names function {named!r}, which is not in tools (they are: {', '.join(seen)})", "tool_choice"
        )
    _check_messages(req)
    fmt = template_format(tool_template(tok))
    return ToolPlan(
        fmt=fmt or HERMES,
        tools=tuple((t.function.name, t.function.parameters) for t in req.tools),
        specs=tuple(t.model_dump(exclude_none=True) for t in req.tools),
        choice="required" if named else choice or "auto",  # OpenAI: "auto" when tools are given
        named=named,
        parallel=req.parallel_tool_calls is not False,
        native=fmt is not None,
    )


def _check_schema(runtime, schema, param: str, name: str) -> None:
    from ...runtime.grammar import schema_error

    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise _bad(
            f"{param} of {name!r} must be a JSON Schema of an object (arguments are named); "
            f"got type {schema.get('type')!r}",
            "tools",
        )
    try:
        err = schema_error(runtime.tokenizer, schema, vocab_size=runtime.model.config.vocab_size)
    except ImportError as e:  # the [structured] extra is not installed on this server
        raise _bad(f"tool calling is not available here ({e})", "tools") from None
    if err:
        raise _bad(f"{param} of {name!r}: {err}", "tools")


def _check_messages(req: ChatCompletionRequest) -> None:
    """Tool results answer calls made before them; tool_calls come from the assistant only."""
    ids: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.tool_calls and m.role != "assistant":
            raise _bad(f"messages[{i}] has tool_calls, which only role 'assistant' may carry", "messages")
        for c in m.tool_calls or ():
            ids.add(c.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise _bad(
                    f"messages[{i}] has role 'tool' but no tool_call_id; set it to the id of the call it answers",
                    f"messages[{i}].tool_call_id",
                    "invalid_messages",
                )
            if m.tool_call_id not in ids:
                raise _bad(
                    f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant "
                    "message; a 'tool' message must follow the assistant message whose tool_calls hold that id",
                    f"messages[{i}].tool_call_id",
                    "invalid_messages",
                )


# ---------------------------------------------------------------- the prompt
def template_messages(req: ChatCompletionRequest, tools: ToolPlan | None) -> tuple[list[dict], dict]:
    """-> (messages as the template takes them, extra template context such as tools=)."""
    native = tools is not None and tools.native
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        content = (
            m.content if isinstance(m.content, str) or m.content is None else "\n".join(part.text for part in m.content)
        )
        # "developer" is OpenAI's newer name for "system"; templates know only the latter
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [
                _call_dict(c, f"messages[{i}].tool_calls[{j}]", native) for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            msg["name"] = m.name
        out.append(msg)
    if native:
        return out, {"tools": [dict(s) for s in tools.specs]}
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in out):
        return out, {}
    return _plain_turns(out, tools), {}


def _call_dict(call, param: str, native: bool) -> dict:
    """An assistant's call as HF's templates take it: arguments as an object, not JSON text
    (our own turns keep the text as it was generated)."""
    args = call.function.arguments
    if native:
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise _bad(f"{param}.function.arguments is not JSON: {args[:80]!r}", "messages") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def render_call(fmt: CallFormat, name: str, arguments: str) -> str:
    """One call as the model writes it (the grammar's text exactly)."""
    return f"{fmt.open}{name}{fmt.mid}{arguments}{fmt.close}"


def _plain_turns(messages: list[dict], tools: ToolPlan | None) -> list[dict]:
    """Our preamble in the system turn; calls as the assistant's text; results as a user turn."""
    out: list[dict] = []
    results = False  # the last turn holds tool results
    for m in messages:
        if m.get("tool_calls"):
            calls = [render_call(HERMES, c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = HERMES.sep.join(calls)
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:  # consecutive results: one user turn, as Qwen's template does
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append(dict(m))
        results = m["role"] == "tool"
    if tools is not None:
        listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in tools.specs)
        preamble = PREAMBLE.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# ---------------------------------------------------------------- decoding
def with_tools(runtime, params, tools: ToolPlan | None, text_grammar: str | None = None):
    """params plus the processor of the tool grammar (tool_choice "none": unchanged). text_grammar:
    a Lark expression for the text branch of "auto" (a response_format's), else free text."""
    if tools is None or not tools.calls:
        return params
    from ...runtime.grammar import lark_processor

    tok = runtime.tokenizer
    marks = {m for t in (tools.fmt.open, tools.fmt.close) for m in re.findall(r"<[^<>\s]+>", t)}
    special = frozenset(m for m in marks if tok.token_to_id(m) in tok.special_token_ids)
    try:
        lark = tool_grammar(
            tools.fmt,
            [t for t in tools.tools if tools.named in (None, t[0])],
            choice=tools.choice,
            parallel=tools.parallel,
            text=text_grammar,
            special=special,
        )
        proc = lark_processor(runtime.tokenizer, lark, vocab_size=runtime.model.config.vocab_size, what="tool grammar")
    except ValueError as e:
        raise _bad(f"tools: {e}", "tools") from None
    return dataclasses.replace(params, logits_processors=(*params.logits_processors, proc))


def text_grammar_of(fmt) -> str | None:
    """A response_format as the Lark expression of auto's text branch (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "%json " + json.dumps({"type": "object"})
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        return "%json " + json.dumps(fmt.json_schema.schema_)
    raise APIError(
        400,
        f"response_format {fmt.type!r} cannot be combined with tool calls; use json_schema or json_object",
        param="response_format",
        code="invalid_response_format",
    )


__all__ = ["ToolPlan", "plan", "template_messages", "with_tools", "arguments_schema", "render_call"]
