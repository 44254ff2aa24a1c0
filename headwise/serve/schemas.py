"""The OpenAI API's request and response bodies (the subset headwise serves), as pydantic models.

Requests forbid unknown fields: a typo ("max_token") or a field that tries to point
the server elsewhere ("base_url") is a 400 naming it, not silently ignored. Bounds
live in the fields, so /openapi.json states them and FastAPI enforces them. Tools and
tool_choice: docs/tools.md; response_format: docs/structured-outputs.md; bookkeeping fields (user, metadata, store,
prompt_cache_key, safety_identifier, verbosity, modalities ["text"]) are accepted and ignored;
reasoning_effort only as "none".
Types are strict, as OpenAI's are: `"logprobs": "yes"` or `"max_tokens": "5"` is a 400 naming
the field, not coerced (a number field still takes an integer: 1 for 1.0). Responses are
declared for the docs and schema checks; handlers build plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..runtime.sampling import MAX_STOP_CHARS, MAX_STOPS

NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOPS)], None]


class Strict(BaseModel):
    # strict: no "yes" -> True, no "5" -> 5 (pydantic's lax mode would); ints still pass as floats
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: Optional[bool] = None  # a last chunk with usage and no choices


class ResumeFields(Strict):
    """Continue a completion another server began (the gateway's failover, serve/failover.py)."""

    token_ids: Annotated[list[TokenId], Field(min_length=1)]  # generated so far; read as prompt now
    text_chars: Annotated[int, Field(ge=0)]  # characters of their text the client already has


class HeadwiseFields(Strict):
    """headwise's own request extension, for a gateway in front of replicas; OpenAI clients never
    need it (the gateway strips what it asked for before the client sees a chunk)."""

    token_ids: bool = False  # each streamed chunk carries "headwise": {"token_ids": [...]}
    resume: Optional[ResumeFields] = None


class SamplingFields(Strict):
    """Fields chat and completions share; the vLLM extensions (top_k, min_p,
    repetition_penalty, ignore_eos, stop_token_ids) map onto headwise.SamplingParams."""

    model: NonEmpty
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None  # below 1e-5: greedy, as vLLM
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=16)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Stop = None
    seed: Optional[Annotated[int, Field(ge=0, le=2**63 - 1)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None  # on the output's ids, as OpenAI
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    # token id (a string, as JSON keys are) -> bias; ids are checked against the model's vocabulary
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    user: Optional[str] = None
    # OpenAI's bookkeeping, accepted and ignored: they do not change the answer (a prompt cache
    # here is keyed by the prompt's tokens; abuse reports are the operator's)
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # vLLM-style extensions
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    min_p: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    repetition_penalty: Optional[Annotated[float, Field(ge=0.01, le=10)]] = None  # tinier: logits overflow
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=64)]] = None
    headwise: Optional[HeadwiseFields] = None  # token ids in chunks, resume after ids (replicas)
    # vLLM's: lower is served first. It orders requests of equal fair share (a client's and a
    # request's running sequences count first: runtime/fair.py), so no value starves the others
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0


# ---------------------------------------------------------------- chat
class TextPart(Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names (their API rejects others)
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(Strict):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON Schema of the arguments object; none: no arguments
    strict: Optional[bool] = None  # the arguments always match here, strict or not (docs/tools.md)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: NonEmpty


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: NonEmpty
    arguments: str  # the arguments object as JSON text
    # openai-python's parse() keeps its pydantic object here and sends it back with the message: ignored
    parsed_arguments: Optional[Any] = None


class ToolCall(Strict):
    id: NonEmpty
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant turns that called tools
    tool_call_id: Optional[str] = None  # role "tool": the call this is the result of
    refusal: Optional[str] = None  # echoed back by clients that resend an assistant message; unused
    parsed: Optional[Any] = None  # openai-python's parse() result, resent the same way; unused


class JSONSchemaFormat(Strict):
    """OpenAI's response_format.json_schema; the schema is enforced whatever `strict` says
    (docs/structured-outputs.md), a feature the grammar library lacks is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)  # dumps "schema"
    name: Optional[Annotated[str, Field(min_length=1, max_length=64)]] = None  # OpenAI's clients always send it
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")  # `schema` would shadow BaseModel.schema
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    # "regex" (with `pattern`) is headwise's extension; json_object / json_schema as OpenAI
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: Optional[JSONSchemaFormat] = None
    pattern: Optional[Annotated[str, Field(min_length=1, max_length=4096)]] = None


class Prediction(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (docs/predicted-outputs.md)."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    response_format: Optional[ResponseFormat] = None
    prediction: Optional[Prediction] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = None  # OpenAI's limit too
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # accepted and ignored: text is the only output modality ("audio" is a 400 naming it), and
    # verbosity is a hint to reasoning models (gpt-5), which the served models are not
    modalities: Optional[list[Literal["text"]]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    # changes a reasoning model's answer: only "none" is served (openai/common.py reject_unsupported)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None


# ---------------------------------------------------------------- completions
Prompt = Union[
    str,
    Annotated[list[str], Field(min_length=1, max_length=64)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)],
]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    echo: Optional[bool] = None  # only false is served
    suffix: Optional[str] = None  # only null is served
    best_of: Optional[Annotated[int, Field(ge=1, le=16)]] = None  # only == n is served
    response_format: Optional[ResponseFormat] = None  # headwise's extension: OpenAI has it on chat only


# ---------------------------------------------------------------- embeddings
class EmbeddingRequest(Strict):
    model: NonEmpty
    input: Union[
        str,
        Annotated[list[str], Field(min_length=1, max_length=2048)],
        Annotated[list[TokenId], Field(min_length=1)],
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    ]
    encoding_format: Literal["float", "base64"] = "float"  # the openai client asks for base64
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None  # only the model's own width
    user: Optional[str] = None


# ---------------------------------------------------------------- responses
class PredictionUsage(BaseModel):
    accepted_prediction_tokens: int  # output tokens that followed the request's prediction
    rejected_prediction_tokens: int  # predicted tokens computed and dropped


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    completion_tokens_details: Optional[PredictionUsage] = None  # only when the request sent a prediction


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # ids "call_<hex>"; arguments: JSON text


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _ChatChoiceBase(BaseModel):
    index: int
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class _ResponseBase(BaseModel):
    id: str
    created: int
    model: str
    usage: Optional[Usage] = None


class ChatChoice(_ChatChoiceBase):
    message: AssistantMessage


class ChatCompletion(_ResponseBase):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class FunctionDelta(BaseModel):
    name: Optional[str] = None  # in a call's first delta
    arguments: Optional[str] = None  # "" first, then fragments that join into the arguments' JSON


class ToolCallDelta(BaseModel):
    index: int  # which call of the message
    id: Optional[str] = None  # first delta of the call only
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionDelta] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(_ChatChoiceBase):
    delta: ChatDelta


class ChatCompletionChunk(_ResponseBase):
    """One SSE event of a chat stream (`data: {...}`); the stream ends with `data: [DONE]`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class Completion(_ResponseBase):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    status: Optional[str] = None  # local models: loading | ready | failed
    error: Optional[str] = None  # why it failed
    # local models once ready: {"parameters", "kv_bytes_per_token" (the engine's pool), "kv_pool_blocks",
    # "kv_layer_types" where layers differ in window ([{"window": W or None, "layers", "kv_bytes_per_token"}]),
    # and for a pruned folder "pruned": {"kv_heads_per_layer"}, "quality": what `headwise analyze` measured}
    headwise: Optional[dict] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 502, 503, 504)}


def sse_docs(chunk: type[BaseModel]) -> dict:
    """The 200 answer of a streaming-capable endpoint: JSON, or SSE events of `chunk`."""
    return {
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "string",
                        "description": f"stream=true: `data: <{chunk.__name__}>` events, then `data: [DONE]`",
                    }
                }
            }
        }
    }
