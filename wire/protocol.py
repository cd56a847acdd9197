"""The engine wire contract: ``POST /inference/v1/generate`` and ``/inference/v1/abort_requests``.

Wire-compatible with vLLM 0.32's token-in/token-out protocol, so a stock vLLM
server is a valid engine for the ``tokens`` and ``text`` modes and a onehop
engine answers vLLM's clients. ``output_mode="derender"`` comes in two forms:

- onehop's: the request carries the original OpenAI request
  (``chat_request``/``completion_request``) once and the engine answers with
  OpenAI ``ChatCompletion``/``Completion`` objects (and their chunks), ready
  to relay;
- vLLM 0.33's: the request carries the slim ``parse_context`` its ``/render``
  fills (or nothing, on a server without parsers), is never streamed, and the
  answer is a ``GenerateDerenderResponse``: the parsed assistant message per
  choice beside the usual generate fields.

Errors:

    ProtocolError (ValueError)   a body that breaks this contract; the server answers 400
    EngineError                  the engine answered with an OpenAI-shaped error body

Decoding responses: a missing ``output_mode`` means ``tokens`` (servers that
predate the field never send it). Each response struct carries its mode as a
msgspec tag, so it is always encoded, checked when present and optional when
decoding one known type. Callers that know the mode they asked for pass it to
``decode_generate_response``/``decode_generate_stream_chunk`` and pay for one
decode; without it, a small view of the routing keys is decoded first.

Encoding differs from vLLM in bytes, not meaning: stream chunks (the per-token
hot path) and logprob entries omit fields at their defaults, where vLLM writes
``null``/``[]`` (missing and default decode the same on both sides).
Non-streaming responses emit every field, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from wire.openai_schema import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionMessage,
    ChatLogprobs,
    ChatTool,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    NamedToolChoice,
    PerRequestMetrics,
    PromptLogprobs,
    RepetitionDetectionParams,
    StreamOptions,
    TokenId,
    Usage,
    json_depth,
    random_uuid,
    too_deep,
)

__all__ = [
    "AbortAnswer",
    "AbortRequest",
    "EngineError",
    "GenerateDerenderChoice",
    "GenerateDerenderResponse",
    "GenerateLogProb",
    "GenerateLogProbs",
    "GenerateLogProbsContent",
    "GenerateRequest",
    "GenerateRequestView",
    "GenerateTextChoice",
    "GenerateTextResponse",
    "GenerateTextStreamChoice",
    "GenerateTextStreamResponse",
    "GenerateTokensChoice",
    "GenerateTokensResponse",
    "GenerateTokensStreamChoice",
    "GenerateTokensStreamResponse",
    "OutputMode",
    "ParseContext",
    "ProtocolError",
    "ReasoningParserKwargs",
    "SamplingParams",
    "StreamOptions",
    "WeightVersionSpan",
    "decode_abort_answer",
    "decode_abort_request",
    "decode_generate_derender_response",
    "decode_generate_request",
    "decode_generate_request_view",
    "decode_generate_response",
    "decode_generate_stream_chunk",
    "encode",
    "sampling_params_sent_keys",
]

OutputMode = Literal["tokens", "text", "derender"]

_CACHE_SALT_MAX_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class ProtocolError(ValueError):
    """A request or response that breaks the engine contract."""


class EngineError(Exception):
    """The engine answered (or ended a stream) with an OpenAI-shaped error."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


# ------------------------------------------------------------ request


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""vLLM's structured-output constraints, one of which a `StructuredOutputs` sets."""


class StructuredOutputs(Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """vLLM 0.32's ``StructuredOutputsParams`` as JSON carries it: exactly one constraint
    (``json`` a JSON schema, as an object or its text; ``regex``; ``choice``; ``grammar``
    (EBNF/Lark); ``json_object``; ``structural_tag``) and its options."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Set by vLLM's own processor, and echoed when it serializes the params.
    backend: str | None = msgspec.field(default=None, name="_backend")
    backend_was_auto: bool = msgspec.field(default=False, name="_backend_was_auto")

    def __post_init__(self) -> None:
        count = len(self.kinds())
        if count != 1:  # vLLM's rule and words
            which = "multiple are specified" if count else "none are specified"
            raise ProtocolError(f"You can only use one kind of structured outputs constraint but {which}")

    def kinds(self) -> list[str]:
        return [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]

    @property
    def kind(self) -> str:
        """The one constraint this sets (`json`, `regex`, ...)."""
        return self.kinds()[0]


class SamplingParams(Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """vLLM 0.32's ``SamplingParams`` as JSON carries it, with its defaults.

    Every field vLLM accepts from JSON is declared, so any body vLLM takes
    decodes here and a misspelt one is refused by name instead of ignored.
    Range checks are vLLM's ``_verify_args``; its normalisations (a lone
    ``stop`` string to a list, ``seed=-1`` to none, tiny temperatures raised)
    are the backend's business.
    """

    n: Annotated[int, Meta(ge=1)] = 1
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    watermarking: bool | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # 0 or -1: all tokens
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # How many top alternatives to return per token (-1: the whole vocabulary);
    # the sampled token is always reported too. None: no logprobs.
    logprobs: Annotated[int, Meta(ge=-1)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=-1)] | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: Literal[0, 1, 2] = 0  # vLLM's RequestOutputKind: cumulative, delta, final only
    stream_interval: Annotated[int, Meta(ge=1)] | None = None
    skip_clone: bool = False
    # Derived by vLLM's own constructor, but its /render output echoes it.
    output_text_buffer_length: int = 0
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ProtocolError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or ()
        if any(not s for s in stops):
            raise ProtocolError("stop cannot contain an empty string")
        if stops and not self.detokenize:
            raise ProtocolError("stop strings need sampling_params.detokenize to be true")
        if self.bad_words and any(not w for w in self.bad_words):
            raise ProtocolError("bad_words cannot contain an empty string")


class ReasoningParserKwargs(Struct, forbid_unknown_fields=True):
    """What ``/render`` tells the engine's reasoning parser (``enable_thinking``, ...)."""

    chat_template_kwargs: dict[str, Any] = {}


class ParseContext(Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """vLLM 0.33's ``ParseContext``: what its ``/render`` keeps of a chat request so a
    generate server can parse the output (``output_mode="derender"``), defaults and all.

    vLLM keeps unknown fields and refuses them only in derender mode (a newer
    ``/render``); here they are refused by name at every level, as everywhere
    in this contract.
    """

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    # With /render's defaults applied (add_generation_prompt, enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] = {}
    # Tool calls already in the rendered conversation, for sequential ids.
    history_tool_call_cnt: Annotated[int, Meta(ge=0)] = 0


class Callee(Struct, frozen=True):
    """What a chat tool call's (flattened) name stands for in the client's API."""

    name: str
    namespace: str | None = None
    custom: bool = False
    """A custom tool: its call's `{"input": ...}` arguments are the item's free text."""


class ResponsesPresent(Struct, tag_field="api", tag="responses", forbid_unknown_fields=True, kw_only=True):
    """Answer as OpenAI's Responses API (`wire.responses`), assembled by `derender.responses`."""

    response: dict[str, Any]
    """The Response as it starts (`in_progress`, no output, no usage): its id, model and the
    request's settings echoed, which the gateway knows and the engine does not."""
    callees: dict[str, Callee] = {}
    """Chat function names that stand for a namespace's tool or a custom tool (others are plain)."""
    text_call: Callee | None = None
    """A forced custom tool whose grammar the turn's text follows: the text is its call."""


class MessagesPresent(Struct, tag_field="api", tag="messages", forbid_unknown_fields=True, kw_only=True):
    """Answer as Anthropic's Messages API (`wire.messages`), assembled by `derender.messages`."""

    id: str
    model: str
    """The name the answer carries (the client's, which may be an alias)."""
    stop_sequences: list[str] = []
    context_management: dict[str, Any] | None = None
    """What the request's `context_management` edits did, reported as Anthropic does."""


Present = ResponsesPresent | MessagesPresent


class GenerateRequest(Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    request_id: str = msgspec.field(default_factory=random_uuid)
    token_ids: Annotated[list[TokenId], Meta(min_length=1)]
    token_offsets: list[tuple[int, int]] | None = None
    # Multimodal input, relayed to a backend that takes it; null reads as absent.
    features: msgspec.Raw | UnsetType = UNSET
    content_parts: list[msgspec.Raw] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: OutputMode = "tokens"
    # vLLM 0.33: read only with output_mode="derender" (ignored at other levels,
    # so a rendered request can go to a prefill leg unchanged).
    parse_context: ParseContext | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's field allows 1024 characters, but its validator stops at 128.
    cache_salt: Annotated[str, Meta(min_length=1, max_length=_CACHE_SALT_MAX_CHARS)] | None = None
    priority: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    # onehop extension, read only with output_mode="derender": the original
    # OpenAI request (exactly one of the two), sent once for the request's life.
    chat_request: ChatCompletionRequest | None = None
    completion_request: CompletionRequest | None = None
    # Which prompt of a multi-prompt completion_request this is: the engine
    # numbers its choices from prompt_index * n, as vLLM's /v1/completions
    # does, so the gateway can relay several engines' chunks unchanged.
    prompt_index: Annotated[int, Meta(ge=0)] = 0
    # onehop extension, with a chat_request: answer in another API's shape (its events
    # when streamed, its object when not) instead of chat's. One choice only.
    present: Present | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """The cross-field rules; field types and ranges are checked by the decoder."""
        deep = self._too_deep()
        if deep is not None:
            raise ProtocolError(f"{deep} nests deeper than {MAX_JSON_DEPTH} levels")
        if self.cache_salt is not None and not _CACHE_SALT_FORBIDDEN.isdisjoint(self.cache_salt):
            raise ProtocolError("cache_salt must not contain '@', '/', '\\' or NUL")
        if self.content_parts and _raw_present(self.features):
            raise ProtocolError("content_parts and features are mutually exclusive")
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ProtocolError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        if self.output_mode == "derender":
            self._validate_derender()
        elif self.chat_request is not None or self.completion_request is not None:
            raise ProtocolError("chat_request and completion_request need output_mode='derender'")
        if self.present is not None:
            if self.chat_request is None:
                raise ProtocolError("present needs output_mode='derender' and a chat_request")
            if self.sampling_params.n != 1:
                raise ProtocolError("present answers one choice: sampling_params.n must be 1")

    def _too_deep(self) -> str | None:
        """The first free-form JSON field nesting deeper than MAX_JSON_DEPTH (the engine is
        reachable directly, so it bounds this itself), or None."""
        own = {
            "sampling_params.extra_args": self.sampling_params.extra_args,
            "kv_transfer_params": self.kv_transfer_params,
            "ec_transfer_params": self.ec_transfer_params,
        }
        if isinstance(self.present, ResponsesPresent):
            own["present.response"] = self.present.response
        elif isinstance(self.present, MessagesPresent):
            own["present.context_management"] = self.present.context_management
        context = self.parse_context
        if context is not None:
            own["parse_context.chat_template_kwargs"] = context.chat_template_kwargs
            for i, tool in enumerate(context.tools or ()):
                own[f"parse_context.tools[{i}].function.parameters"] = tool.function.parameters
        for name, value in own.items():
            if value is not None and json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                return name
        for name, original in (("chat_request", self.chat_request), ("completion_request", self.completion_request)):
            inner = too_deep(original) if original is not None else None
            if inner is not None:
                return f"{name}.{inner}"
        return None

    @property
    def vllm_derender(self) -> bool:
        """Derender in vLLM 0.33's form: no OpenAI request, a `GenerateDerenderResponse` answer."""
        return self.output_mode == "derender" and self.chat_request is None and self.completion_request is None

    def _validate_derender(self) -> None:
        originals = [r for r in (self.chat_request, self.completion_request) if r is not None]
        if not originals:
            if self.stream:  # vLLM 0.33's rule and words
                raise ProtocolError("output_mode='derender' does not support stream=true.")
            return
        if len(originals) != 1:
            raise ProtocolError(
                "output_mode='derender' needs exactly one of chat_request and completion_request"
            )
        if self.parse_context is not None:
            raise ProtocolError(
                "parse_context (vLLM's derender) and chat_request/completion_request (onehop's) are exclusive"
            )
        if bool(originals[0].stream) != bool(self.stream):
            raise ProtocolError("stream must match the stream of the original request")


ABORT_HANDLE_SEPARATOR = "#"
"""A gateway's engine request id is `<id>#<handle>`: the handle is a secret the gateway draws
per request and never logs, so only it can abort the request (`/abort_requests` takes the
whole id); logs, traces and answer ids show `public_request_id`, the part before it."""


def public_request_id(request_id: str) -> str:
    """The request id without its abort handle: what may be logged or shown to a client."""
    return request_id.partition(ABORT_HANDLE_SEPARATOR)[0]


class AbortRequest(Struct, forbid_unknown_fields=True):
    request_ids: list[str]


class _SamplingView(Struct):
    n: int = 1
    logprobs: int | None = None
    max_tokens: int | None = 16


class GenerateRequestView(Struct):
    """The routing keys of a generate body, decoded without the rest (token ids, media)."""

    output_mode: str = "tokens"
    stream: bool | None = False
    model: str | None = None
    request_id: str | None = None  # None: the engine will make one up
    sampling_params: _SamplingView = msgspec.field(default_factory=_SamplingView)


class _SamplingKeys(Struct):
    sampling_params: dict[str, msgspec.Raw] = {}


def _raw_present(raw: msgspec.Raw | UnsetType) -> bool:
    return raw is not UNSET and bytes(raw) != b"null"


# ------------------------------------------------------------ logprobs


class GenerateLogProb(Struct, omit_defaults=True):
    """One (token id, logprob) candidate; ``rank`` is null where the engine has none."""

    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb, omit_defaults=True):
    """The sampled token at one position, then its candidates: sampled first, then by rank."""

    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(Struct, omit_defaults=True):
    content: list[GenerateLogProbsContent] | None = None


class WeightVersionSpan(Struct):
    """Output tokens ``[start, end)`` were sampled by weights labelled ``version``."""

    version: str
    start: int
    end: int


# ------------------------------------------------------------ non-streaming responses


class _GenerateChoiceBase(Struct, kw_only=True):
    index: int
    finish_reason: str | None = "stop"
    # The stop string or token id that ended generation; null on EOS, length, abort.
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    routed_experts: str | None = None  # base64 .npy
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateTokensChoice(_GenerateChoiceBase, kw_only=True):
    logprobs: GenerateLogProbs | None = None


class GenerateTextChoice(_GenerateChoiceBase, kw_only=True):
    # Leaves out a matched stop string (unless include_stop_str_in_output);
    # token_ids keep every generated token, so re-decoding them is not this text.
    text: str
    logprobs: ChatLogprobs | None = None


class GenerateDerenderChoice(_GenerateChoiceBase, kw_only=True):
    """vLLM 0.33's derender choice: the assistant message parsed from the output.

    ``message`` is vLLM's ``ChatMessage`` (``reasoning``, no ``tool_calls`` key
    without calls); ``logprobs``, ``token_ids`` and ``sampling_mask`` are null
    when ``include_reasoning=false`` hides the reasoning they would reveal.
    """

    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None


class _GenerateResponseBase(Struct, kw_only=True):
    request_id: str = msgspec.field(default_factory=random_uuid)
    model: str | None = None
    created: int | None = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None
    metrics: PerRequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class GenerateTokensResponse(
    _GenerateResponseBase, tag_field="output_mode", tag="tokens", kw_only=True
):
    output_mode: ClassVar[str] = "tokens"
    choices: list[GenerateTokensChoice]


class GenerateTextResponse(
    _GenerateResponseBase, tag_field="output_mode", tag="text", kw_only=True
):
    output_mode: ClassVar[str] = "text"
    choices: list[GenerateTextChoice]


class GenerateDerenderResponse(
    _GenerateResponseBase, tag_field="output_mode", tag="derender", kw_only=True
):
    """vLLM 0.33's answer to a non-streaming ``output_mode="derender"`` request."""

    output_mode: ClassVar[str] = "derender"
    choices: list[GenerateDerenderChoice]


# ------------------------------------------------------------ stream chunks (hot path)


class _GenerateStreamChoiceBase(Struct, omit_defaults=True, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # New tokens of this chunk. A final text-mode chunk may carry text held
    # back for stop-string matching with no new ids, or only a finish_reason.
    token_ids: list[TokenId] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None  # final chunk only


class GenerateTokensStreamChoice(_GenerateStreamChoiceBase, omit_defaults=True, kw_only=True):
    logprobs: GenerateLogProbs | None = None


class GenerateTextStreamChoice(_GenerateStreamChoiceBase, omit_defaults=True, kw_only=True):
    text: str  # the delta since this choice's previous chunk
    logprobs: ChatLogprobs | None = None


class _GenerateStreamResponseBase(Struct, omit_defaults=True, kw_only=True):
    request_id: str = msgspec.field(default_factory=random_uuid)
    usage: Usage | None = None
    prompt_token_ids: list[TokenId] | None = None  # first chunk, with return_token_ids
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None
    metrics: PerRequestMetrics | None = None


class GenerateTokensStreamResponse(
    _GenerateStreamResponseBase, tag_field="output_mode", tag="tokens", kw_only=True
):
    output_mode: ClassVar[str] = "tokens"
    choices: list[GenerateTokensStreamChoice]


class GenerateTextStreamResponse(
    _GenerateStreamResponseBase, tag_field="output_mode", tag="text", kw_only=True
):
    output_mode: ClassVar[str] = "text"
    choices: list[GenerateTextStreamChoice]


GenerateResponse = (
    GenerateTokensResponse | GenerateTextResponse | GenerateDerenderResponse | ChatCompletion | Completion
)
GenerateStreamResponse = (
    GenerateTokensStreamResponse
    | GenerateTextStreamResponse
    | ChatCompletionChunk
    | CompletionChunk
)


class _ResponseView(Struct):
    output_mode: str = "tokens"
    object: str | UnsetType = UNSET  # set on derender's OpenAI objects
    error: ErrorInfo | UnsetType = UNSET


class EngineSummary(Struct, kw_only=True):
    """onehop's addition: what a request produced, for the gateway's trace span.

    Sent as the `onehop-engine-summary` header on JSON answers and as an SSE
    comment (`: onehop-engine-summary={...}`) before `[DONE]` on streams, so
    the gateway can report finish reasons and usage on the derender route
    without decoding the OpenAI objects it relays. Clients skip comments.
    """

    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    # Added later: an engine that does not send them reads as zeros.
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    error_status: int | None = None
    """Streams: the status of the error event the engine ended the stream with after its first
    byte (None: it ended whole), so a gateway relaying the bytes counts the request as failed."""


SUMMARY_HEADER = "onehop-engine-summary"
SUMMARY_COMMENT = b": onehop-engine-summary="


class AbortAnswer(Struct, kw_only=True):
    """onehop's addition: the answer to `/abort_requests`, what each aborted request used.

    A client that leaves mid-stream takes the engine's summary with it (it comes at the
    stream's end), so the gateway asks the abort for it: the engine answers, for each id it
    knows (running ones once they have stopped, briefly waited for, and recently ended ones),
    what that request produced. An engine without this (vLLM) answers without a body; the
    gateway then knows nothing of the cut request's usage, as before.
    """

    usage: dict[str, EngineSummary] = {}


# ------------------------------------------------------------ codecs, built once

_ENCODER = msgspec.json.Encoder()
encode = _ENCODER.encode

_REQUEST = msgspec.json.Decoder(GenerateRequest)
_REQUEST_VIEW = msgspec.json.Decoder(GenerateRequestView)
_SAMPLING_KEYS = msgspec.json.Decoder(_SamplingKeys)
_ABORT = msgspec.json.Decoder(AbortRequest)
_ABORT_ANSWER = msgspec.json.Decoder(AbortAnswer)
_RESPONSE_VIEW = msgspec.json.Decoder(_ResponseView)
_ERROR = msgspec.json.Decoder(ErrorResponse)
_SUMMARY = msgspec.json.Decoder(EngineSummary)

_RESPONSES: dict[str, msgspec.json.Decoder[Any]] = {
    "tokens": msgspec.json.Decoder(GenerateTokensResponse),
    "text": msgspec.json.Decoder(GenerateTextResponse),
    "derender": msgspec.json.Decoder(GenerateDerenderResponse),
    "chat.completion": msgspec.json.Decoder(ChatCompletion),
    "text_completion": msgspec.json.Decoder(Completion),
}
_CHUNKS: dict[str, msgspec.json.Decoder[Any]] = {
    "tokens": msgspec.json.Decoder(GenerateTokensStreamResponse),
    "text": msgspec.json.Decoder(GenerateTextStreamResponse),
    "chat.completion.chunk": msgspec.json.Decoder(ChatCompletionChunk),
    "text_completion": msgspec.json.Decoder(CompletionChunk),
}


_T = TypeVar("_T")


def _decode(decoder: msgspec.json.Decoder[_T], data: bytes, what: str) -> _T:
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ProtocolError(f"invalid {what}: {exc}") from exc
    except RecursionError as exc:  # the decoder's own bound: far deeper than MAX_JSON_DEPTH
        raise ProtocolError(f"invalid {what}: JSON nested too deeply") from exc


def decode_generate_request(data: bytes) -> GenerateRequest:
    return _decode(_REQUEST, data, "generate request")


def decode_generate_request_view(data: bytes) -> GenerateRequestView:
    return _decode(_REQUEST_VIEW, data, "generate request")


def sampling_params_sent_keys(data: bytes) -> frozenset[str]:
    """The ``sampling_params`` keys a generate body set explicitly.

    A decoded ``SamplingParams`` cannot tell a sent ``max_tokens=16`` from the
    default; vLLM applies the model's generation-config defaults only to keys
    that were not sent, and an engine doing the same needs this.
    """
    return frozenset(_decode(_SAMPLING_KEYS, data, "generate request").sampling_params)


def decode_abort_request(data: bytes) -> AbortRequest:
    return _decode(_ABORT, data, "abort request")


def decode_abort_answer(data: bytes) -> AbortAnswer:
    return _decode(_ABORT_ANSWER, data, "abort answer")


def decode_generate_response(data: bytes, mode: OutputMode | None = None) -> GenerateResponse:
    """A non-streaming ``/inference/v1/generate`` body; raises EngineError for an error body."""
    return cast(GenerateResponse, _dispatch(_RESPONSES, data, mode, "generate response"))


def decode_generate_derender_response(data: bytes) -> GenerateDerenderResponse:
    """vLLM 0.33's non-streaming derender answer (one decode); raises EngineError for an error body."""
    try:
        return cast(GenerateDerenderResponse, _RESPONSES["derender"].decode(data))
    except msgspec.DecodeError as exc:
        _raise_engine_error(data)
        raise ProtocolError(f"invalid generate derender response: {exc}") from exc


def decode_generate_stream_chunk(
    data: bytes, mode: OutputMode | None = None
) -> GenerateStreamResponse:
    """One SSE ``data:`` payload (without the prefix, not ``[DONE]``) of a generate stream.

    Pass the ``output_mode`` the request asked for: the chunk is then decoded
    once, and a chunk of another mode is refused. A derender stream always
    needs the view (its chunks are chat or completion objects).
    """
    if mode is not None and mode != "derender":
        try:  # the usual chunk, decoded in place (once a token: no call more than needed)
            chunk: GenerateStreamResponse = _CHUNKS[mode].decode(data)
            return chunk
        except msgspec.DecodeError:
            pass  # `_dispatch` says what it is (an engine's error, or what is wrong)
    return cast(GenerateStreamResponse, _dispatch(_CHUNKS, data, mode, "generate stream chunk"))


def _dispatch(
    decoders: dict[str, msgspec.json.Decoder[Any]], data: bytes, mode: str | None, what: str
) -> Any:
    if mode is not None and mode != "derender":
        try:
            return decoders[mode].decode(data)
        except msgspec.DecodeError as exc:
            _raise_engine_error(data)
            raise ProtocolError(f"invalid {what}: {exc}") from exc
    view = _decode(_RESPONSE_VIEW, data, what)
    if view.error is not UNSET:
        raise EngineError(view.error)
    key = view.object if view.object is not UNSET else view.output_mode
    if mode == "derender" and view.object is UNSET:
        raise ProtocolError(f"invalid {what}: a derender answer must be an OpenAI object")
    decoder = decoders.get(key)
    if decoder is None:
        raise ProtocolError(f"invalid {what}: unknown output_mode or object {key!r}")
    return _decode(decoder, data, what)


def _raise_engine_error(data: bytes) -> None:
    try:
        body = _ERROR.decode(data)
    except msgspec.DecodeError:
        return
    raise EngineError(body.error)


def decode_summary(data: bytes | str) -> EngineSummary | None:
    """An engine summary (header value or comment payload); None when malformed: it is advisory."""
    try:
        return _SUMMARY.decode(data)
    except msgspec.DecodeError:
        return None


def find_summary(tail: bytes) -> EngineSummary | None:
    """The summary comment in the last bytes of an engine stream, if the engine sent one."""
    at = tail.rfind(SUMMARY_COMMENT)
    if at < 0:
        return None
    start = at + len(SUMMARY_COMMENT)
    end = tail.find(b"\n", start)
    return decode_summary(tail[start:] if end < 0 else tail[start:end])
