"""The Messages API request (https://docs.anthropic.com/en/api/messages), the subset headwise serves.

As Anthropic's API does, an unknown field is a 400 ("Extra inputs are not permitted" there,
"unknown field" here), and `max_tokens` is required. Fields Anthropic documents that cannot
change a local model's answer (thinking, MCP servers, containers) are accepted only at their
neutral value and otherwise rejected with a message naming them; bookkeeping (metadata,
service_tier) is accepted and ignored. Client tools (`tools`, `tool_choice`, `tool_use` and
`tool_result` blocks) are served: translate.py. Content blocks other than text, tool_use and
tool_result (images, documents) and Anthropic's server tools are a 400 "not supported" from
translate.py, not a schema error, so the message can say so.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..schemas import NonEmpty, StopString, Strict
from ...runtime.sampling import MAX_STOPS


class Block(Strict):
    """A content block. Only {"type": "text", "text": ...} is served; the fields of other types are
    kept (extra="allow") so the handler can name the type it does not serve."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: NonEmpty
    text: Optional[str] = None
    cache_control: Optional[dict] = None  # prompt caching hints: nothing to do here
    citations: Optional[list] = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None
    citations: Optional[list] = None


class Message(Strict):
    role: Literal["user", "assistant"]  # the system prompt is the top-level `system`
    content: Union[str, list[Block]]


class ToolUseIn(Strict):
    """An assistant turn's call, sent back: {"type": "tool_use", "id", "name", "input"}."""

    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict
    cache_control: Optional[dict] = None
    caller: Optional[dict] = None  # who called it (Anthropic's programmatic tool calling): direct here


class ToolResultIn(Strict):
    """A user turn's result for one call: {"type": "tool_result", "tool_use_id", "content", "is_error"}."""

    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: Union[str, list[Block]] = ""  # text blocks served; other types: a 400 naming them
    is_error: Optional[bool] = None
    cache_control: Optional[dict] = None


class CustomTool(Strict):
    """A client tool (https://docs.anthropic.com/en/docs/agents-and-tools/tool-use): the model writes its
    `input` as JSON matching input_schema; the application runs it. Server tools (web_search_..., bash_...,
    text_editor_..., computer_...) carry a dated `type` instead: a 400 from translate.py."""

    type: Optional[Literal["custom"]] = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Optional[str] = None
    input_schema: dict  # a JSON Schema of the input object
    strict: Optional[bool] = None  # the input always matches here, strict or not
    cache_control: Optional[dict] = None
    eager_input_streaming: Optional[bool] = None  # input_json_delta pieces stream as written anyway
    input_examples: Optional[list[dict]] = None  # not shown to the model


class ToolChoice(Strict):
    """auto: the model decides; any: some tool; tool: the one named; none: no tool."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[NonEmpty] = None  # type "tool" only
    disable_parallel_tool_use: Optional[bool] = None  # true: at most one tool_use block


class Metadata(Strict):
    user_id: Optional[str] = None


class Thinking(Strict):
    # adaptive / between_tools: the model decides whether to think; a local model without a
    # thinking mode answering straight away is such a decision. enabled asks for thinking blocks: 400
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


class OutputConfig(Strict):
    effort: Optional[str] = None  # how hard Claude tries: nothing to choose here, ignored
    format: Optional[dict] = None  # structured output: not served on /v1/messages yet (a 400)


class MessagesRequest(Strict):
    """The fields of anthropic-python 2.17's messages.create, plus temperature / top_p / top_k,
    which the API documents for the models that take them (that SDK sends them via extra_body)."""

    model: NonEmpty
    max_tokens: Annotated[int, Field(ge=1)]  # required, as Anthropic's API requires it
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[Annotated[list[StopString], Field(max_length=MAX_STOPS)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=1)]] = None  # Anthropic's range; default 1
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    stream: Optional[bool] = False
    # bookkeeping and hints with nothing to change here: accepted, ignored
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict] = None
    diagnostics: Optional[dict] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    tools: Optional[Annotated[list[dict], Field(max_length=128)]] = None  # CustomTool each (translate.py)
    tool_choice: Optional[ToolChoice] = None
    # served only at their neutral value (translate.py says why otherwise)
    output_config: Optional[OutputConfig] = None
    thinking: Optional[Thinking] = None
    mcp_servers: Optional[list[dict]] = None
    container: Optional[Union[str, dict]] = None
    context_management: Optional[dict] = None


# ---------------------------------------------------------------- answers (for /openapi.json)
class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: Optional[int] = None
    cache_read_input_tokens: Optional[int] = None


class ToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str  # "toolu_..."; a tool_result block answers it by tool_use_id
    name: str
    input: dict


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Union[TextContent, ToolUseContent]]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]] = None
    stop_sequence: Optional[str] = None
    usage: MessageUsage


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"]
    error: ErrorDetail


ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 502, 503, 504)}
STREAM = {
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": "stream=true: Anthropic's events (`event: message_start` ... `event: message_stop`)",
                }
            }
        }
    }
}


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    cache_control: Optional[dict] = None
    speed: Optional[str] = None
    output_config: Optional[OutputConfig] = None
    thinking: Optional[Thinking] = None
    tools: Optional[Annotated[list[dict], Field(max_length=128)]] = None
    tool_choice: Optional[ToolChoice] = None


class TokensCount(BaseModel):
    input_tokens: int
