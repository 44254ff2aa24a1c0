"""A Messages request as the OpenAI chat request that serves it (local models and OpenAI-style
upstreams alike), and the pieces of Anthropic's answer both paths build.

    system (string or text blocks)          -> a system message first
    text blocks                             -> text parts; consecutive turns of one role: one turn
    assistant tool_use {id, name, input}    -> tool_calls [{id, type: "function",
                                                function: {name, arguments: JSON text of input}}]
    user tool_result {tool_use_id, content, is_error}
                                            -> a role "tool" message (tool_call_id = tool_use_id),
                                               its text blocks joined; is_error: "Error: " before it
    tools [{name, description, input_schema}] -> [{type: "function", function: {name,
                                                description, parameters: input_schema}}]
    tool_choice auto | any | tool {name} | none
                                            -> "auto" | "required" | {type: "function",
                                               function: {name}} | "none"
    disable_parallel_tool_use: true         -> parallel_tool_calls: false (and one call kept)
    stop_sequences -> stop; max_tokens, temperature, top_p, top_k as they are

A last assistant turn is a prefill (returned apart; messages.py continues it). Anthropic's server
tools (web_search_..., bash_..., text_editor_..., computer_...) and blocks other than text,
tool_use and tool_result are a 400 naming them.
"""

from __future__ import annotations

import json
import uuid

from pydantic import BaseModel, ValidationError

from ..errors import APIError
from ..schemas import ChatCompletionRequest
from .schemas import Block, CustomTool, MessagesRequest, ToolResultIn, ToolUseIn

_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _ENCODE(data).encode() + b"\n\n"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def message(rid, model, content, reason, sequence, input_tokens, output_tokens) -> dict:
    """content: the text (one text block), a list of blocks, or None (no block yet: message_start)."""
    blocks = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _reject_unsupported(req: MessagesRequest) -> None:
    if req.thinking is not None and req.thinking.type == "enabled":
        raise _unsupported("thinking", "extended thinking is not supported by headwise's local models")
    if req.output_config is not None and req.output_config.format is not None:
        raise _unsupported("output_config.format", "structured output (output_config.format) is not supported yet here")
    for param in ("mcp_servers", "container", "context_management"):
        if getattr(req, param):
            raise _unsupported(param, f"{param} is not supported by headwise")


def _parse(model: type[BaseModel], data: dict, where: str):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        at = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}.{at}: {err['msg']}", param=where) from None


def _text_of(b: Block, at: str) -> str:
    """A text block's text; another type is a 400 naming it."""
    if b.type != "text":
        raise APIError(
            400,
            f"{at}: content blocks of type {b.type!r} are not supported here; "
            "headwise's /v1/messages serves text, tool_use and tool_result blocks",
            param=at.rsplit("[", 1)[0],
            code="unsupported_content",
        )
    if b.text is None:
        raise APIError(400, f"{at}.text: Field required", param=at.rsplit("[", 1)[0])
    return b.text


def chat_tools(req: MessagesRequest) -> dict:
    """-> the chat request's tools / tool_choice / parallel_tool_calls (only those set)."""
    tools = []
    for i, t in enumerate(req.tools or ()):
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise APIError(
                400,
                f"tools[{i}]: {kind!r} is one of Anthropic's server tools, which run on Anthropic's servers; "
                "headwise serves client tools ({name, description, input_schema}) that your application runs",
                param=f"tools[{i}].type",
                code="unsupported_tool_type",
            )
        tool = _parse(CustomTool, t, f"tools[{i}]")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        fn.update({k: getattr(tool, k) for k in ("description", "strict") if getattr(tool, k) is not None})
        tools.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: tool names must be unique, got {names}", param="tools")
    out: dict = {"tools": tools} if tools else {}
    choice = req.tool_choice
    if choice is None:
        return out
    if choice.type in ("any", "tool") and not tools:
        raise APIError(400, f"tool_choice.type {choice.type!r} needs at least one tool in tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in names:
            raise APIError(
                400, f"tool_choice.name {choice.name!r} is not the name of a tool in tools", param="tool_choice.name"
            )
        picked = {"type": "function", "function": {"name": choice.name}}
    elif choice.name is not None:
        raise APIError(400, f"tool_choice.name is for type 'tool', not {choice.type!r}", param="tool_choice.name")
    else:
        picked = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if tools:
        out["tool_choice"] = picked
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def max_tool_uses(req: MessagesRequest) -> int | None:
    return 1 if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use else None


def _turns(req: MessagesRequest, has_tools: bool) -> list[dict]:
    """Anthropic's messages -> chat messages (no system)."""
    out: list[dict] = []
    called: set[str] = set()  # tool_use ids so far: a tool_result answers one of them
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if not m.content and not (i == len(req.messages) - 1 and m.role == "assistant"):
            raise APIError(
                400,
                f"messages.{i}: all messages must have non-empty content except for the optional final assistant "
                "message",
                param="messages",
            )
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        parts, calls, results = [], [], []
        for j, b in enumerate(blocks):
            data = b.model_dump(exclude_none=True)
            if b.type == "tool_use" and m.role == "assistant":
                use = _parse(ToolUseIn, data, f"{where}[{j}]")
                called.add(use.id)
                args = json.dumps(use.input, ensure_ascii=False)
                calls.append({"id": use.id, "type": "function", "function": {"name": use.name, "arguments": args}})
            elif b.type == "tool_result" and m.role == "user":
                res = _parse(ToolResultIn, data, f"{where}[{j}]")
                if res.tool_use_id not in called:
                    raise APIError(
                        400,
                        f"{where}[{j}]: tool_result's tool_use_id {res.tool_use_id!r} answers no tool_use block of an "
                        "earlier assistant turn",
                        param=where,
                    )
                text = (
                    res.content
                    if isinstance(res.content, str)
                    else "\n".join(_text_of(c, f"{where}[{j}].content[{k}]") for k, c in enumerate(res.content))
                )
                text = "Error: " + text if res.is_error else text
                results.append({"role": "tool", "tool_call_id": res.tool_use_id, "content": text})
            else:
                parts.append({"type": "text", "text": _text_of(b, f"{where}[{j}]")})
        if (calls or results) and not has_tools:
            raise APIError(
                400, f"{where}: requests with tool_use or tool_result blocks must define tools", param="tools"
            )
        out += results
        if not parts and not calls and results:
            continue
        last = out[-1] if out else None
        if last is not None and last["role"] == m.role and not results:  # consecutive turns of one role: one turn
            last["content"] = (last["content"] or []) + parts
            if calls:
                last.setdefault("tool_calls", []).extend(calls)
        else:
            out.append({"role": m.role, "content": parts or None, **({"tool_calls": calls} if calls else {})})
    return out


def to_chat(req: MessagesRequest) -> tuple[ChatCompletionRequest, str]:
    """-> (the chat request, the assistant prefill or "")."""
    _reject_unsupported(req)
    tools = chat_tools(req)
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else [{"type": "text", "text": b.text} for b in req.system]
        messages.append({"role": "system", "content": system})
    messages += _turns(req, bool(tools.get("tools")))
    prefill = ""
    if req.messages[-1].role == "assistant":  # the answer continues this text
        last = messages.pop()
        if last.get("tool_calls"):
            raise APIError(
                400,
                "the last assistant turn calls tools: send their tool_result blocks in a user turn after it",
                param="messages",
            )
        prefill = "\n".join(p["text"] for p in last["content"] or ())
        if prefill != prefill.rstrip():
            raise APIError(
                400, "final assistant content cannot end with trailing whitespace", param="messages", code="invalid"
            )
        if not any(m["role"] == "user" for m in messages):
            raise APIError(400, "messages: the conversation needs a user turn before the assistant's", param="messages")
    fields = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stream": bool(req.stream),
        **tools,
    }
    if req.stream:
        fields["stream_options"] = {"include_usage": True}  # the usage message_delta reports
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(fields), prefill
    except ValidationError as e:  # our own fields passed our checks: should not happen
        err = e.errors()[0]
        at = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"the request cannot be served as a chat: {at}: {err.get('msg')}") from None
