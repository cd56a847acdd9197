"""OpenAI wire shapes onehop speaks, as msgspec Structs (no torch, vLLM or transformers).

Fields follow the OpenAI reference order; vLLM's extensions (and onehop's, where
there are any) are grouped after them and marked. Defaults are vLLM 0.32's.

Encoding rules, chosen so onehop's bytes look like vLLM's coupled server:

- Requests: ``omit_defaults=True``, so re-encoding one (the ``chat_request`` a
  derender engine receives) sends only what the client changed. ``UNSET``
  marks fields whose absence means something a value cannot (``tool_choice``
  defaults to ``"auto"`` only when tools are given) or that a chat template
  tests with ``is defined`` (message ``name``, ``tool_calls``, ...). Unknown
  fields are accepted and dropped, as OpenAI and vLLM do; refusing the ones
  onehop does not support is the gateway's job.
- Non-streaming responses emit every declared field, ``null`` included: the
  shape of vLLM's ``model_dump()``.
- Stream chunks mirror vLLM's ``model_dump_json(exclude_unset=True)``: fields
  vLLM always sets on a chunk are always emitted (``"logprobs": null``,
  ``"finish_reason": null``); the rest default to ``UNSET`` and appear only
  when the producer sets them (``None`` included, to reproduce vLLM's
  explicit ``"token_ids": null``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0)]
FinishReason = str
"""``"stop"``, ``"length"``, ``"tool_calls"``, ``"abort"``, ... kept open as vLLM does."""


def random_uuid() -> str:
    return uuid.uuid4().hex


def _now() -> int:
    return int(time.time())


def _chat_id() -> str:
    return f"chatcmpl-{random_uuid()}"


def _completion_id() -> str:
    return f"cmpl-{random_uuid()}"


# ------------------------------------------------------------ shared pieces


class StreamOptions(Struct, omit_defaults=True):
    include_usage: bool | None = False
    # vLLM extension: usage on every chunk, not only the last.
    continuous_usage_stats: bool | None = False


class FunctionDefinition(Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # vLLM drops these two from the dict it hands the chat template when they
    # are null, so they are UNSET here unless the client sent them.
    strict: bool | UnsetType | None = UNSET
    defer_loading: bool | UnsetType | None = UNSET


class ChatTool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | UnsetType | None = UNSET  # vLLM extension


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class RepetitionDetectionParams(Struct, omit_defaults=True):
    """vLLM extension: end generation early on a repeating N-gram."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


# ------------------------------------------------------------ chat request


class ChatContentPart(Struct, omit_defaults=True):
    """One part of a list-valued message ``content``; the media fields pass through."""

    # vLLM infers a missing type from the part's keys.
    type: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    refusal: str | UnsetType = UNSET
    image_url: dict[str, Any] | UnsetType = UNSET
    input_audio: dict[str, Any] | UnsetType = UNSET
    file: dict[str, Any] | UnsetType = UNSET
    # vLLM extensions
    audio_url: dict[str, Any] | UnsetType = UNSET
    video_url: dict[str, Any] | UnsetType = UNSET


class ChatMessageParam(Struct, omit_defaults=True):
    role: str
    content: str | list[ChatContentPart] | UnsetType | None = UNSET
    name: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType | None = UNSET
    tool_call_id: str | UnsetType | None = UNSET
    # vLLM extension: reasoning of an earlier assistant turn, for interleaved thinking.
    reasoning: str | UnsetType | None = UNSET
    # The deprecated spelling; folded into `reasoning` on decode, as vLLM does.
    reasoning_content: str | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.reasoning_content is not UNSET:
            if self.reasoning_content is not None and self.reasoning in (UNSET, None):
                self.reasoning = self.reasoning_content
            self.reasoning_content = UNSET


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's chat request and vLLM's extensions to it; any other field is refused by name
    (vLLM only warns: a misspelt parameter would change nothing, silently)."""

    messages: list[ChatMessageParam]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0  # null means 0
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatTool] | None = None
    # Not sent means "auto" when tools are given, else "none": see effective_tool_choice().
    tool_choice: ToolChoice | UnsetType | None = UNSET
    reasoning_effort: ReasoningEffort | None = None
    parallel_tool_calls: bool | None = True
    user: str | None = None
    # OpenAI fields that change nothing a self-hosted model answers: accepted, not acted on.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # OpenAI fields refused by name when set (gateway/edge/validate.py).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    # vLLM extensions: reasoning
    thinking_token_budget: int | None = None
    include_reasoning: bool = True
    # vLLM extensions: sampling
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    # vLLM extensions: rendering and request handling
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: Int64 = 0
    request_id: str = msgspec.field(default_factory=random_uuid)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Meta(ge=0)] = 0
    return_token_offsets: bool | None = False
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None  # deprecated alias of mm_payload
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    stream_interval: Annotated[int, Meta(ge=1)] | None = None

    def effective_tool_choice(self) -> ToolChoice | None:
        """``tool_choice`` as vLLM resolves it when the client left it out."""
        if self.tool_choice is UNSET:
            return "auto" if self.tools else "none"
        return self.tool_choice


# ------------------------------------------------------------ completion request

PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's completions request and vLLM's extensions to it; any other field is refused."""

    model: str | None = None
    # str | list[str] | list[int] | list[list[int]]; msgspec takes one array
    # type per union, so the list is checked for a single kind after decode.
    prompt: str | list[PromptItem] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None  # top-k count, unlike chat's bool
    max_tokens: int | None = 16  # null means 16, as in vLLM
    n: int = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    best_of: int | None = None  # refused above 1 (gateway/edge/validate.py), as vLLM's v1 engine does

    # vLLM extensions: sampling
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = []
    # vLLM extensions: request handling
    prompt_embeds: str | list[str] | None = None  # base64 tensors, passed through as text
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: Int64 = 0
    request_id: str = msgspec.field(default_factory=random_uuid)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Meta(ge=0)] = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = 16
        if isinstance(self.prompt, list) and self.prompt:
            kind = type(self.prompt[0])
            if any(type(item) is not kind for item in self.prompt):
                raise ValueError(
                    "prompt must be a string, a list of strings, a list of token ids "
                    "or a list of token id lists, not a mix"
                )


# ------------------------------------------------------------ logprobs, usage, metrics


class TopLogprob(Struct):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogprobToken(Struct):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct):
    content: list[ChatLogprobToken] | None = None


class PromptLogprob(Struct):
    """vLLM extension: one candidate of ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class PromptTokensDetails(Struct):
    cached_tokens: int | None = None
    # vLLM extensions
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0


class Usage(Struct):
    # Null details are written out, as in vLLM's full responses; vLLM's final
    # usage chunk drops them (exclude_none), which reads the same to a client.
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class SpeculativeDecodingMetrics(Struct):
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None


class PerRequestMetrics(Struct):
    """vLLM extension: timings of one request, on the last response or chunk."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None
    speculative_decoding: SpeculativeDecodingMetrics | None = None


# ------------------------------------------------------------ chat responses


class ChatCompletionMessage(Struct, kw_only=True):
    # Key order of OpenAI's and vLLM's JSON (role first), not of the reference page.
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    # vLLM leaves the key out when there are no calls.
    tool_calls: list[ToolCall] | UnsetType = UNSET
    # vLLM extension. The producer picks the spelling clients get: `reasoning`
    # (vLLM's, emitted as null when empty), `reasoning_content` (the older
    # alias other servers use), or both; set `reasoning` to UNSET to drop it.
    reasoning: str | UnsetType | None = None
    reasoning_content: str | UnsetType | None = UNSET


class ChatCompletionChoice(Struct, kw_only=True):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = "stop"
    # vLLM extensions
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class ChatCompletion(Struct, kw_only=True):
    id: str = msgspec.field(default_factory=_chat_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: Usage
    # vLLM extensions
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: PerRequestMetrics | None = None


class DeltaFunctionCall(Struct):
    name: str | UnsetType | None = UNSET
    arguments: str | UnsetType | None = UNSET


class DeltaToolCall(Struct, kw_only=True):
    index: int
    id: str | UnsetType | None = UNSET
    type: Literal["function"] | UnsetType | None = UNSET
    function: DeltaFunctionCall | UnsetType | None = UNSET


class ChatDelta(Struct):
    """A chat stream delta: only the fields this chunk changes are emitted."""

    role: str | UnsetType | None = UNSET
    content: str | UnsetType | None = UNSET
    # vLLM extension, and its alias: see ChatCompletionMessage.
    reasoning: str | UnsetType | None = UNSET
    reasoning_content: str | UnsetType | None = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatCompletionChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM extensions
    stop_reason: int | str | UnsetType | None = UNSET
    token_ids: list[int] | UnsetType | None = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str = msgspec.field(default_factory=_chat_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | UnsetType | None = UNSET
    system_fingerprint: str | UnsetType | None = UNSET
    # vLLM extensions, first chunk (prompt) or last chunk (metrics) only
    prompt_token_ids: list[int] | UnsetType | None = UNSET
    prompt_text: str | UnsetType | None = UNSET
    metrics: PerRequestMetrics | UnsetType | None = UNSET


# ------------------------------------------------------------ completion responses


class CompletionLogprobs(Struct):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM extensions
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None


class Completion(Struct, kw_only=True):
    id: str = msgspec.field(default_factory=_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: Usage
    # vLLM extensions
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: PerRequestMetrics | None = None


class CompletionChunkChoice(Struct, kw_only=True):
    # vLLM sets every one of these on every chunk, so all are emitted.
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM extensions
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionChunk(Struct, kw_only=True):
    id: str = msgspec.field(default_factory=_completion_id)
    # OpenAI streams completions under the same object name as the full response.
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | UnsetType | None = UNSET
    system_fingerprint: str | UnsetType | None = UNSET
    metrics: PerRequestMetrics | UnsetType | None = UNSET  # vLLM extension


# ------------------------------------------------------------ errors and models


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    # OpenAI sends a string code or null; vLLM sends the HTTP status as an int.
    code: int | str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "onehop"  # vLLM says "vllm"
    # vLLM extensions
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = []


class ModelList(Struct):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []


# ------------------------------------------------------------ nesting bound

MAX_JSON_DEPTH = 64
"""How deep a free-form JSON value (a tool's parameters, chat_template_kwargs, ...) may nest.
Deeper values exhaust recursion in decoders, encoders and the template engine (985
levels did); real schemas nest a handful of levels."""

FREE_FORM_FIELDS = (
    "chat_template_kwargs", "response_format", "structured_outputs", "mm_processor_kwargs",
    "media_io_kwargs", "kv_transfer_params", "ec_transfer_params",
)
"""Request fields that hold JSON of any shape (the tools' parameters are the other one)."""


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` nests (0 for a scalar), counted iteratively and up to `limit` + 1 only."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def too_deep(request: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The first free-form field of `request` that nests deeper than MAX_JSON_DEPTH, if any."""
    values = [(name, getattr(request, name, None)) for name in FREE_FORM_FIELDS]
    tools = getattr(request, "tools", None) or ()
    values += [(f"tools[{i}].function.parameters", tool.function.parameters) for i, tool in enumerate(tools)]
    for name, value in values:
        if value is not None and json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return name
    return None


# ------------------------------------------------------------ codecs, built once

ENCODER = msgspec.json.Encoder()
CHAT_COMPLETION_REQUEST_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_REQUEST_DECODER = msgspec.json.Decoder(CompletionRequest)
CHAT_COMPLETION_DECODER = msgspec.json.Decoder(ChatCompletion)
CHAT_COMPLETION_CHUNK_DECODER = msgspec.json.Decoder(ChatCompletionChunk)
COMPLETION_DECODER = msgspec.json.Decoder(Completion)
COMPLETION_CHUNK_DECODER = msgspec.json.Decoder(CompletionChunk)
ERROR_RESPONSE_DECODER = msgspec.json.Decoder(ErrorResponse)
MODEL_LIST_DECODER = msgspec.json.Decoder(ModelList)
