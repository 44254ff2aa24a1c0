"""The /v1/responses request and its translation into the chat request that serves it.

    input: a string, or items:
      message (input_text / output_text parts)      -> a chat message of that role
      function_call (call_id, name, arguments)      -> an assistant message's tool_calls
                                                       (consecutive calls: one message)
      function_call_output (call_id, output)        -> a role "tool" message, tool_call_id = call_id
    instructions                                    -> a system message first
    tools [{type: "function", name, description, parameters, strict}]
                                                    -> chat's [{type: "function", function: {...}}]
    tool_choice none / auto / required / {type: "function", name} -> chat's, the name nested
    parallel_tool_calls, max_output_tokens (max_tokens), temperature, top_p, user
    text.format                                     -> response_format

OpenAI's built-in tools (web_search, file_search, computer_use_preview, code_interpreter, mcp,
...) run on OpenAI's servers, not in the model: a 400 naming the tool type.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationError

from ..errors import APIError
from ..schemas import ChatCompletionRequest, NonEmpty, Strict


class InputPart(Strict):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn sent back as input
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


class InputMessage(Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCall(Strict):
    """A call the model made (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str  # JSON text, as the model wrote it
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutput(Strict):
    """The application's result for one call."""

    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: Union[str, list[InputPart]]
    id: Optional[str] = None
    status: Optional[str] = None


def _kind(item) -> str:
    """An item without `type` is a message (EasyInputMessage)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


InputItem = Annotated[
    Union[
        Annotated[InputMessage, Tag("message")],
        Annotated[FunctionCall, Tag("function_call")],
        Annotated[FunctionCallOutput, Tag("function_call_output")],
    ],
    Discriminator(
        _kind,
        custom_error_type="unsupported_item",
        custom_error_message="an input item's type is message (the default), function_call or function_call_output; "
        "other items (reasoning, item_reference, built-in tool calls) are not served here",
    ),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for function names
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON Schema of the arguments
    strict: Optional[bool] = None


class TextConfig(Strict):
    format: Optional[dict] = None  # {"type": "text"} | {"type": "json_schema", "name", "schema", "strict"}
    verbosity: Optional[str] = None


class ResponsesRequest(Strict):
    model: NonEmpty
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None  # headwise: false unless set (OpenAI: true)
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[dict]] = None  # function tools (FunctionTool); a built-in tool's type is a 400
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None  # the answer's first calls, the rest dropped
    reasoning: Optional[dict] = None  # only null / {}
    background: Optional[bool] = None  # only false
    top_logprobs: Optional[int] = None  # only 0
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[dict] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None


def reject_unsupported(req: ResponsesRequest) -> None:
    checks = {
        "reasoning": (not req.reasoning, "reasoning options are not supported: headwise's models do not reason"),
        "background": (not req.background, "background responses are not supported; stream instead"),
        "top_logprobs": (not req.top_logprobs, "top_logprobs is not supported yet on /v1/responses"),
    }
    for param, (ok, message) in checks.items():
        if not ok:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for i, t in enumerate(req.tools or ()):
        kind = t.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}]: tool type {kind!r} is not served here: headwise serves function tools "
                "(type 'function', run by your application); built-in tools such as web_search, file_search "
                "or computer_use_preview run on OpenAI's servers",
                param=f"tools[{i}].type",
                code="unsupported_tool_type",
            )
        try:
            tools.append(FunctionTool.model_validate(t))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise APIError(400, f"tools[{i}].{where}: {err['msg']}", param=f"tools[{i}].{where}") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    return tools


def _tool_choice(req: ResponsesRequest, tools: list[FunctionTool]):
    choice = req.tool_choice
    if choice is None or choice == "none" or choice == "auto":
        return choice
    if isinstance(choice, dict):
        if (
            choice.get("type") != "function"
            or not isinstance(choice.get("name"), str)
            or set(choice) > {"type", "name"}
        ):
            raise APIError(
                400,
                f"tool_choice {choice!r} is not served: use none, auto, required or "
                '{"type": "function", "name": ...} (built-in tools and allowed_tools are not served here)',
                param="tool_choice",
            )
        if choice["name"] not in [t.name for t in tools]:
            raise APIError(
                400, f"tool_choice names function {choice['name']!r}, which is not among tools", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    if not tools:  # "required"
        raise APIError(400, "tool_choice 'required' needs at least one function in tools", param="tool_choice")
    return choice


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """This turn's input as chat messages; a function_call_output must answer a call made before it
    (in this input or in the stored conversation of previous_response_id)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    for i, item in enumerate(req.input):
        if isinstance(item, FunctionCall):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            calls.add(item.call_id)
            if out and out[-1]["role"] == "assistant":  # the answer's text and its calls: one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            if item.call_id not in calls:
                raise APIError(
                    400,
                    f"input[{i}]: no function_call with call_id {item.call_id!r} comes before this "
                    "function_call_output (in input, or in the response of previous_response_id)",
                    param=f"input[{i}].call_id",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            out.append({"role": item.role, "content": _text(item.content)})
    return out


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":  # the Responses API puts name / schema / strict beside the type
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, f"text.format type {kind!r} is not one of text, json_schema, json_object", param="text.format")


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """-> (the chat request to send, this turn's messages: history + input, for the store)."""
    reject_unsupported(req)
    tools = function_tools(req)
    choice = _tool_choice(req, tools)
    messages = history + input_messages(req, history)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict = {"model": req.model, "messages": system + messages, "stream": bool(req.stream)}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
    ):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools
        ]
    if choice is not None and tools:  # none / auto without tools: nothing to choose from
        body["tool_choice"] = choice
    if req.max_tool_calls == 1:
        body["parallel_tool_calls"] = False  # one call at most: ask for one
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(body), messages
    except ValidationError as e:  # chat's schema refuses what ours let through: the client's request still
        raise APIError(400, f"the request cannot be served as a chat completion: {e.errors()[0]['msg']}") from None


def echo_tools(req: ResponsesRequest) -> list[dict]:
    """The response object's `tools`: the function tools as sent."""
    return [t.model_dump() for t in function_tools(req)]
