"""OpenAI's Responses API (`POST /v1/responses`) as a chat completion.

`decode_request` reads the request (what is not served is refused by name), `to_chat` turns
it into the chat request the pipeline runs, and `ResponsesPresenter` turns the chat answer
into a Response object, or the chat chunks into the Responses events:

    response.created, response.in_progress           (after the first chunk: an engine that
    (response.output_item.added                       fails before it gets an HTTP status)
      reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
      message:   content_part.added, output_text.delta*, output_text.done, content_part.done
      call:      function_call_arguments.delta*, function_call_arguments.done
      custom:    custom_tool_call_input.delta*, custom_tool_call_input.done
     response.output_item.done)*                     one item open at a time, a new one
    response.completed | response.incomplete         whenever the kind of delta changes

Input items become chat messages in `gateway.apis.responses_input`; namespace, custom and built-in
tools become chat tools, and the model's calls their items again, in `gateway.apis.agent_tools`.

Every event has one `sequence_number` from 0, the error event included. A finished response
is kept with the chat conversation it ended in this replica's store (`gateway.apis.response_store`),
scoped to its caller, so that `previous_response_id` continues it without the client sending
it again.

Names follow the `openai` SDK's types. An unknown top-level request field is ignored or refused
by name, as `agents.unknown_fields` says (`gateway.edge.unknown_fields`); items, tools and the small
config objects are not, because clients send back the items of earlier answers with fields
OpenAI keeps adding.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageParam,
    DeltaToolCall,
    FunctionCall,
    Int64,
    NamedFunction,
    NamedToolChoice,
    ReasoningEffort,
    ToolCall,
    ToolChoice,
    TopLogprob,
    Usage,
)
from gateway.apis.agent_tools import (
    HOSTED_TYPES,
    AgentTools,
    Callee,
    CustomInputStream,
    Tool,
    ToolPolicy,
    agent_tools,
    checked_tools,
    custom_arguments,
    custom_input,
    flat_name,
    forced_constraint,
)
from gateway.edge.errors import GatewayError, InvalidRequest
from gateway.apis.response_store import ResponseStorage
from gateway.apis.responses_input import (
    Conversation,
    InputItem,
    one_system_turn,
    with_instructions,
    without_instructions,
)
from gateway.apis.translate import Presented, Turn
from gateway.edge.unknown_fields import Decoded, TolerantDecoder
from gateway.edge.validate import check_metadata

# ------------------------------------------------------------ request

class NamedChoice(Struct, kw_only=True, omit_defaults=True):
    """A forced call: of a function or custom tool by `name` (`namespace` for one inside a
    namespace), or of a built-in tool by its type alone."""

    type: str
    name: str | None = None
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.type not in ("function", "custom") and self.type not in HOSTED_TYPES:
            raise ValueError(f"tool_choice of type '{self.type}' is not supported")
        if self.type in ("function", "custom") and self.name is None:
            raise ValueError(f"a {self.type} tool_choice needs `name`")


ResponsesToolChoice = Literal["none", "auto", "required"] | NamedChoice


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and (self.name is None or self.schema is None):
            raise ValueError("a json_schema format needs `name` and `schema`")


class TextConfig(Struct, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not acted on


class ReasoningConfig(Struct, omit_defaults=True):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None  # no summaries are written
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated spelling


class ResponsesRequest(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """OpenAI's Responses request; any other field is refused by name."""

    background: bool | None = None  # refused when true
    client_metadata: dict[str, Any] | None = None  # Codex's turn metadata: accepted, not acted on
    conversation: str | dict[str, Any] | None = None  # refused when set
    include: list[str] | None = None  # any value; only message.output_text.logprobs changes the answer
    input: str | list[InputItem] = []
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_tool_calls: int | None = None  # counts calls of built-in tools, of which there are none here
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None  # refused when set
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing is obfuscated
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: ResponsesToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None  # `auto` accepted; nothing is cut
    user: str | None = None

    # vLLM extensions: sampling, passed to the chat request as they are (see SAMPLING_EXTRAS)
    top_k: int | None = None
    seed: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constraint options (`disable_any_whitespace`, ...), kept beside `text.format` as chat keeps them."""


SAMPLING_EXTRAS = (
    "top_k", "seed", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens", "ignore_eos",
    "stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "bad_words", "allowed_token_ids", "logit_bias",
)
"""vLLM's sampling fields a chat request takes beyond OpenAI's Responses ones (load generators
such as guidellm and aiperf send `ignore_eos`, `min_tokens`, ...); unset ones keep chat's defaults."""


class _LenientResponsesRequest(ResponsesRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


_DECODER = TolerantDecoder(ResponsesRequest, _LenientResponsesRequest)
_encode = msgspec.json.Encoder().encode
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_LOCATED = re.compile(r"(.*) - at `\$\.?([^`]*)`")
_UNSERVED: list[tuple[str, Callable[[ResponsesRequest], bool], str]] = [
    ("background", lambda r: bool(r.background), "background responses are not supported"),
    ("conversation", lambda r: r.conversation is not None, "conversations are not supported: use previous_response_id"),
    ("prompt", lambda r: r.prompt is not None, "stored prompt templates are not supported"),
]


def decode_request(body: bytes, *, ignore_unknown: bool = True) -> Decoded[ResponsesRequest]:
    try:
        decoded = _DECODER.decode(body, ignore_unknown=ignore_unknown)
    except msgspec.DecodeError as exc:
        raise _invalid(str(exc)) from exc
    except RecursionError as exc:  # msgspec's own bound, far deeper than any we accept
        raise InvalidRequest("invalid responses request: JSON nested too deeply") from exc
    request = decoded.request
    for name, asks, why in _UNSERVED:
        if asks(request):
            raise InvalidRequest(f"{name}: {why}", param=name)
    check_metadata(request.metadata)
    return decoded


def _invalid(text: str) -> InvalidRequest:
    """msgspec's words as OpenAI's: an unknown top-level field gets `unknown_parameter`,
    anything else names where it is (`tools[0]`, `input[2].content[0]`)."""
    if unknown := _UNKNOWN.fullmatch(text):
        name = unknown.group(1)
        return InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    if located := _LOCATED.fullmatch(text):
        detail, param = located.groups()
        return InvalidRequest(f"Invalid '{param}': {detail}", param=param)
    return InvalidRequest(f"invalid responses request: {text}")


# ------------------------------------------------------------ request → chat request

_DEFAULT_POLICY = ToolPolicy()


def to_chat(
    request: ResponsesRequest, history: list[ChatMessageParam], policy: ToolPolicy = _DEFAULT_POLICY
) -> ChatCompletionRequest:
    """`history`: the conversation stored for `previous_response_id`. Its instructions were not
    stored (OpenAI's rule): only this request's come first."""
    tools = checked_tools(request.tools, policy)
    items = [InputItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    conversation = Conversation([*history]).add(items)
    if not conversation:
        raise InvalidRequest("input must not be empty", param="input")
    messages = with_instructions(request.instructions, one_system_turn(conversation))
    choice = _chat_tool_choice(request.tool_choice, tools, policy)
    forced = bool(tools.chat) and (choice == "required" or isinstance(choice, NamedToolChoice))
    constraint = request.structured_outputs
    if (grammar := _forced_grammar(request, policy)) is not None:  # the call is the turn's text
        choice, forced, constraint = "none", False, grammar
    logprobs = bool(request.top_logprobs) or "message.output_text.logprobs" in (request.include or ())
    effort = request.reasoning.effort if request.reasoning is not None else None
    extras = {name: value for name in SAMPLING_EXTRAS if (value := getattr(request, name)) is not None}
    return ChatCompletionRequest(
        messages=messages,
        model=request.model,
        logprobs=logprobs,
        top_logprobs=request.top_logprobs or 0,
        max_completion_tokens=request.max_output_tokens,
        n=1,
        # A forced call's turn answers with the call, not text: the format waits for the turn
        # that answers in text (OpenAI takes both; instructor's RESPONSES_TOOLS mode sends both).
        response_format=None if forced or grammar else _response_format(request.text),
        stream=bool(request.stream),
        temperature=request.temperature,
        top_p=request.top_p,
        tools=tools.chat or None,
        tool_choice=choice if tools.chat else UNSET,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        user=request.user,
        reasoning_effort=effort,
        chat_template_kwargs=_template_kwargs(effort),
        structured_outputs=None if forced else constraint,
        **extras,
    )


def _chat_tool_choice(
    choice: ResponsesToolChoice | None, tools: AgentTools, policy: ToolPolicy
) -> ToolChoice | UnsetType:
    """A forced built-in tool is forced no more when the tool is dropped: the model answers
    as with `auto` (an agent's run goes on); `agents.hosted_tools: refuse` makes it a 400."""
    if choice is None:
        return UNSET
    if isinstance(choice, str):
        return choice
    if choice.type in HOSTED_TYPES:
        if policy.hosted == "refuse":
            raise InvalidRequest(f"tool_choice of type '{choice.type}' is not served here", param="tool_choice.type")
        return UNSET
    return NamedToolChoice(function=NamedFunction(flat_name(choice.name or "", choice.namespace)))


def _forced_grammar(request: ResponsesRequest, policy: ToolPolicy) -> dict[str, str] | None:
    choice = request.tool_choice
    if not isinstance(choice, NamedChoice) or choice.type != "custom" or choice.name is None:
        return None
    return forced_constraint(request.tools, choice.name, choice.namespace, policy.enforced)


def forced_custom(request: ResponsesRequest) -> bool:
    """Whether the request forces a custom tool (whose grammar its engines may enforce)."""
    choice = request.tool_choice
    return isinstance(choice, NamedChoice) and choice.type == "custom"


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": form.name, "schema": form.schema, "strict": form.strict, "description": form.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _template_kwargs(effort: ReasoningEffort | None) -> dict[str, Any] | None:
    """Thinking on or off for templates that switch it (Qwen3's `enable_thinking`), and the
    effort itself for those that take it (gpt-oss's `reasoning_effort`), as vLLM passes it."""
    if effort is None:
        return None
    return {"enable_thinking": effort != "none", "reasoning_effort": effort}


# ------------------------------------------------------------ the answer

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class TopLogprobOut(Struct):
    token: str
    logprob: float
    bytes: list[int] | UnsetType = UNSET  # in output_text parts; the delta events carry none


class LogprobOut(Struct):
    token: str
    logprob: float
    top_logprobs: list[TopLogprobOut]
    bytes: list[int] | UnsetType = UNSET


class OutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[LogprobOut] = []


class ReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: ItemStatus = "completed"


class MessageItem(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    namespace: str | UnsetType = UNSET  # a namespace's tool: `name` is the plain name


class CustomToolCallItem(Struct, kw_only=True, tag_field="type", tag="custom_tool_call"):
    id: str
    call_id: str
    name: str
    input: str
    namespace: str | UnsetType = UNSET
    status: ItemStatus | UnsetType = UNSET  # not in OpenAI's item: written only when a limit cut it


OutputItem = ReasoningItem | MessageItem | FunctionCallItem | CustomToolCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # required by the SDK's model; not measured here


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str


class Response(Struct, kw_only=True):
    """Every field is written, null included, as OpenAI's are; the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ItemStatus
    background: bool = False
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    text: TextConfig
    tool_choice: ResponsesToolChoice = "auto"
    tools: list[Tool] = []
    """The tools the model was given (a dropped built-in tool is not among them)."""
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


_PLAIN_TEXT = TextConfig(format=TextFormat(type="text"))
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""The chat finish reasons that leave a response incomplete, with OpenAI's reason for each."""


_ECHOED = (
    "instructions", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt_cache_key", "reasoning",
    "safety_identifier", "temperature", "top_p", "user",
)
"""Request fields a Response repeats as they were sent."""


def _response(
    request: ResponsesRequest,
    meta: Presented,
    output: list[OutputItem],
    usage: ResponseUsage | None,
    finish: str | None,
) -> Response:
    """`finish`: the chat finish reason, None while the answer is still to come."""
    reason = _INCOMPLETE.get(finish or "")
    status: ItemStatus = "in_progress" if finish is None else "incomplete" if reason else "completed"
    return Response(
        id=meta.response_id, created_at=meta.created, status=status, model=meta.model, output=output, usage=usage,
        completed_at=int(time.time()) if status == "completed" else None,
        incomplete_details=IncompleteDetails(reason) if reason else None,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        store=request.store is not False,
        text=request.text or _PLAIN_TEXT,
        tool_choice=request.tool_choice or "auto",
        tools=[tool for tool in request.tools or () if tool.type not in HOSTED_TYPES],
        top_logprobs=request.top_logprobs or 0,
        truncation=request.truncation or "disabled",
        metadata=request.metadata or {},
        **{name: getattr(request, name) for name in _ECHOED},
    )


def _output(
    message: ChatCompletionMessage, logprobs: ChatLogprobs | None, tools: AgentTools, text_call: Callee | None
) -> list[OutputItem]:
    items: list[OutputItem] = []
    if reasoning := _present(message.reasoning) or _present(message.reasoning_content):
        items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(reasoning)]))
    if text_call is not None:
        namespace = text_call.namespace if text_call.namespace is not None else UNSET
        custom_call = CustomToolCallItem(
            id=_item_id("ctc"),
            call_id=_item_id("call"),
            name=text_call.name,
            input=message.content or "",
            namespace=namespace,
        )
        return [*items, custom_call]
    if message.content:
        text = OutputText(text=message.content, logprobs=_logprobs(_tokens(logprobs), with_bytes=True))
        items.append(MessageItem(id=_item_id("msg"), status="completed", content=[text]))
    for call in message.tool_calls or ():
        items.append(_call_item(tools, call.id, call.function.name, call.function.arguments, "completed"))
    return items


def _call_item(tools: AgentTools, call_id: str, flat: str, arguments: str, status: ItemStatus) -> OutputItem:
    """The model's call of a (flattened) chat function as the Responses item of its tool."""
    callee = tools.callee(flat)
    namespace = callee.namespace if callee.namespace is not None else UNSET
    if callee.custom:
        return CustomToolCallItem(
            id=_item_id("ctc"), call_id=call_id, name=callee.name, input=custom_input(arguments), namespace=namespace
        )
    return FunctionCallItem(
        id=_item_id("fc"), call_id=call_id, name=callee.name, arguments=arguments, status=status, namespace=namespace
    )


def _usage(usage: Usage | UnsetType | None) -> ResponseUsage | None:
    if not usage:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    output = usage.completion_tokens or 0
    details = InputTokensDetails(cached_tokens=cached or 0), OutputTokensDetails(reasoning_tokens=reasoning)
    return ResponseUsage(usage.prompt_tokens, details[0], output, details[1], usage.total_tokens)


def _logprobs(tokens: Iterable[ChatLogprobToken], with_bytes: bool) -> list[LogprobOut]:
    def raw(entry: ChatLogprobToken | TopLogprob) -> list[int] | UnsetType:
        if not with_bytes:
            return UNSET
        return entry.bytes if entry.bytes is not None else list(entry.token.encode())

    def top(entry: TopLogprob) -> TopLogprobOut:
        return TopLogprobOut(entry.token, entry.logprob, raw(entry))

    return [LogprobOut(t.token, t.logprob, [top(entry) for entry in t.top_logprobs], raw(t)) for t in tokens]


def _tokens(logprobs: ChatLogprobs | None) -> list[ChatLogprobToken]:
    return (logprobs.content or []) if logprobs is not None else []


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _present(value: str | UnsetType | None) -> str | None:
    """A chat field's text, if it has any (chat fields may be UNSET, None or empty)."""
    return value if isinstance(value, str) and value else None


def _assistant(output: list[OutputItem]) -> ChatMessageParam:
    """The answer as the chat message a later turn continues from."""
    reasoning = "".join(part.text for item in output if isinstance(item, ReasoningItem) for part in item.content)
    content = "".join(part.text for item in output if isinstance(item, MessageItem) for part in item.content)
    calls = [_chat_call(item) for item in output if isinstance(item, FunctionCallItem | CustomToolCallItem)]
    return ChatMessageParam(role="assistant", content=content, tool_calls=calls or UNSET, reasoning=reasoning or UNSET)


def _chat_call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    namespace = item.namespace if isinstance(item.namespace, str) else None
    name = flat_name(item.name, namespace)
    arguments = item.arguments if isinstance(item, FunctionCallItem) else custom_arguments(item.input)
    return ToolCall(id=item.call_id, function=FunctionCall(name, arguments))


# ------------------------------------------------------------ stream events


class _Event(Struct, kw_only=True):
    type: str
    sequence_number: int = -1  # numbered as it is written


class LifecycleEvent(_Event, kw_only=True):
    response: Response


class ItemEvent(_Event, kw_only=True):
    output_index: int
    item: OutputItem


class PartEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class DeltaEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int | UnsetType = UNSET
    delta: str
    logprobs: list[LogprobOut] | UnsetType = UNSET


class DoneEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int | UnsetType = UNSET
    text: str | UnsetType = UNSET
    logprobs: list[LogprobOut] | UnsetType = UNSET
    name: str | UnsetType = UNSET  # function_call_arguments.done: OpenAI's events carry the name
    arguments: str | UnsetType = UNSET
    input: str | UnsetType = UNSET  # custom_tool_call_input.done


class ErrorEvent(_Event, kw_only=True):
    code: str | None
    message: str
    param: str | None


class _Streamed:
    """An output item being streamed: its pieces so far, joined once when it closes."""

    def __init__(self, prefix: str, index: int, key: object) -> None:
        self.id, self.index, self.key = _item_id(prefix), index, key
        self.pieces: list[str] = []

    def _item_event(self, kind: str, item: OutputItem) -> ItemEvent:
        return ItemEvent(type=f"response.output_item.{kind}", output_index=self.index, item=item)

    def _part_event(self, kind: str, part: OutputText | ReasoningText) -> PartEvent:
        return PartEvent(type=f"response.content_part.{kind}", item_id=self.id, output_index=self.index, part=part)

    def _delta_event(self, kind: str, text: str, **fields: Any) -> DeltaEvent:
        self.pieces.append(text)
        return DeltaEvent(type=f"response.{kind}.delta", item_id=self.id, output_index=self.index, delta=text, **fields)

    def _done_event(self, kind: str, **fields: Any) -> DoneEvent:
        return DoneEvent(type=f"response.{kind}.done", item_id=self.id, output_index=self.index, **fields)


class _StreamedReasoning(_Streamed):
    def opened(self) -> list[_Event]:
        item = ReasoningItem(id=self.id, status="in_progress")
        return [self._item_event("added", item), self._part_event("added", ReasoningText(""))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> _Event:
        return self._delta_event("reasoning_text", text, content_index=0)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[_Event]]:
        """The finished item, and the events that close it (`output_item.done` last)."""
        part = ReasoningText("".join(self.pieces))
        item = ReasoningItem(id=self.id, content=[part], status=status)
        done = self._done_event("reasoning_text", content_index=0, text=part.text)
        return item, [done, self._part_event("done", part), self._item_event("done", item)]


class _StreamedMessage(_Streamed):
    def __init__(self, prefix: str, index: int, key: object) -> None:
        super().__init__(prefix, index, key)
        self.tokens: list[ChatLogprobToken] = []

    def opened(self) -> list[_Event]:
        item = MessageItem(id=self.id, status="in_progress")
        return [self._item_event("added", item), self._part_event("added", OutputText(text=""))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> _Event:
        self.tokens += tokens
        return self._delta_event("output_text", text, content_index=0, logprobs=_logprobs(tokens, with_bytes=False))

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[_Event]]:
        text = "".join(self.pieces)
        part = OutputText(text=text, logprobs=_logprobs(self.tokens, with_bytes=True))
        item = MessageItem(id=self.id, status=status, content=[part])
        logprobs = _logprobs(self.tokens, with_bytes=False)
        done = self._done_event("output_text", content_index=0, text=text, logprobs=logprobs)
        return item, [done, self._part_event("done", part), self._item_event("done", item)]


class _StreamedCall(_Streamed):
    def __init__(self, prefix: str, index: int, key: object, call_id: str, callee: Callee) -> None:
        super().__init__(prefix, index, key)
        self.call_id, self.callee = call_id, callee
        self.namespace = callee.namespace if callee.namespace is not None else UNSET

    def opened(self) -> list[_Event]:
        return [self._item_event("added", self._item("", "in_progress"))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> _Event | None:
        """The event for `text`; None where a subclass has nothing to show yet."""
        return self._delta_event("function_call_arguments", text)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[_Event]]:
        item = self._item("".join(self.pieces), status)
        done = self._done_event("function_call_arguments", name=self.callee.name, arguments=item.arguments)
        return item, [done, self._item_event("done", item)]

    def _item(self, arguments: str, status: ItemStatus) -> FunctionCallItem:
        return FunctionCallItem(
            id=self.id, call_id=self.call_id, name=self.callee.name, arguments=arguments, status=status,
            namespace=self.namespace,
        )


class _StreamedCustomCall(_StreamedCall):
    """A custom tool's call: the model writes its input as the JSON object `{"input": ...}`,
    and the input's text is streamed as it is decoded (`CustomInputStream`)."""

    def __init__(self, prefix: str, index: int, key: object, call_id: str, callee: Callee) -> None:
        super().__init__(prefix, index, key, call_id, callee)
        self.text = CustomInputStream()
        self.shown: list[str] = []

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> _Event | None:
        self.pieces.append(text)
        shown = self.text.feed(text)
        return self._input_delta(shown) if shown else None

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[_Event]]:
        item = self._custom(custom_input("".join(self.pieces)), status)
        shown = "".join(self.shown)
        rest = item.input[len(shown):] if item.input.startswith(shown) else ""  # arguments not streamed: all of it
        events: list[_Event] = [self._input_delta(rest)] if rest else []
        done = DoneEvent(
            type="response.custom_tool_call_input.done", item_id=self.id, output_index=self.index, input=item.input
        )
        return item, [*events, done, self._item_event("done", item)]

    def opened(self) -> list[_Event]:
        return [self._item_event("added", self._custom("", "in_progress"))]

    def _input_delta(self, text: str) -> DeltaEvent:
        self.shown.append(text)
        return DeltaEvent(
            type="response.custom_tool_call_input.delta", item_id=self.id, output_index=self.index, delta=text
        )

    def _custom(self, text: str, status: ItemStatus) -> CustomToolCallItem:
        return CustomToolCallItem(
            id=self.id, call_id=self.call_id, name=self.callee.name, input=text, namespace=self.namespace,
            status="incomplete" if status == "incomplete" else UNSET,
        )


class _StreamedTextCall(_StreamedCustomCall):
    """A forced custom tool's call that is the turn's text (see `forced_constraint`)."""

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> _Event:
        self.pieces.append(text)
        return self._input_delta(text)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[_Event]]:
        item = self._custom("".join(self.pieces), status)
        done = DoneEvent(
            type="response.custom_tool_call_input.done", item_id=self.id, output_index=self.index, input=item.input
        )
        return item, [done, self._item_event("done", item)]


Streamed = _StreamedReasoning | _StreamedMessage | _StreamedCall


class _StreamedOutput:
    """The output items of one streamed answer. One is open at a time: a delta of another
    kind (or of another tool call) closes it and opens the next."""

    def __init__(self, tools: AgentTools, text_call: Callee | None) -> None:
        self.items: list[OutputItem] = []
        self.open: Streamed | None = None
        self.tools, self.text_call = tools, text_call

    def feed(self, delta: ChatDelta, logprobs: ChatLogprobs | None) -> list[_Event]:  # hot: once per chunk
        events: list[_Event] = []
        if reasoning := _present(delta.reasoning) or _present(delta.reasoning_content):
            events += self._to("reasoning", lambda index: _StreamedReasoning("rs", index, "reasoning"))
            events += self._delta(reasoning, [])
        if content := _present(delta.content):
            events += self._message(content, _tokens(logprobs))
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def close(self, status: ItemStatus) -> list[_Event]:
        if self.open is None:
            return []
        item, events = self.open.closed(status)
        self.items.append(item)
        self.open = None
        return events

    def _to(self, key: object, make: Callable[[int], Streamed]) -> list[_Event]:
        if self.open is not None and self.open.key == key:
            return []
        events = self.close("completed")
        self.open = make(len(self.items))
        return events + self.open.opened()

    def _message(self, content: str, tokens: list[ChatLogprobToken]) -> list[_Event]:
        callee = self.text_call
        if callee is None:
            events = self._to("message", lambda index: _StreamedMessage("msg", index, "message"))
        else:
            events = self._to(
                "text call", lambda index: _StreamedTextCall("ctc", index, "text call", _item_id("call"), callee)
            )
        return events + self._delta(content, tokens)

    def _delta(self, text: str, tokens: list[ChatLogprobToken]) -> list[_Event]:
        assert self.open is not None
        event = self.open.delta(text, tokens)
        return [event] if event is not None else []

    def _call(self, call: DeltaToolCall) -> list[_Event]:
        function = call.function or None
        call_id = call.id if isinstance(call.id, str) else _item_id("call")  # a call's first delta has both
        callee = self.tools.callee((_present(function.name) if function else None) or "")
        key = ("call", call.index)
        make, prefix = (_StreamedCustomCall, "ctc") if callee.custom else (_StreamedCall, "fc")
        events = self._to(key, lambda index: make(prefix, index, key, call_id, callee))
        arguments = _present(function.arguments) if function else None
        if arguments is not None:
            events += self._delta(arguments, [])
        return events


# ------------------------------------------------------------ presenter


class _Frames:
    """Events as SSE frames, numbered in the order they are written."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, events: Iterable[_Event]) -> bytes:
        out = []
        for event in events:
            event.sequence_number = self.sequence
            self.sequence += 1
            out.append(b"event: " + event.type.encode() + b"\ndata: " + _encode(event) + b"\n\n")
        return b"".join(out)


class ResponsesPresenter:
    """Chat answers as Responses (`gateway.apis.translate.Presenter`), one presenter per request;
    a finished response is stored unless the request says `store: false`."""

    def __init__(self, store: ResponseStorage | None, owner: str) -> None:
        self._store, self._owner = store, owner
        self._frames = _Frames()  # one numbering for the stream and its error event

    def whole(self, turn: Turn[ResponsesRequest], meta: Presented, completion: ChatCompletion) -> Response:
        choice = completion.choices[0]
        finish = choice.finish_reason or "stop"
        output = _output(choice.message, choice.logprobs, self._tools(turn), _text_call(turn))
        if output and finish in _INCOMPLETE:
            output[-1].status = "incomplete"  # the item the limit cut, as a stream closes it
        response = _response(turn.original, meta, output, _usage(completion.usage), finish)
        self._keep(turn, response)
        return response

    async def stream(
        self, turn: Turn[ResponsesRequest], meta: Presented, chunks: AsyncGenerator[ChatCompletionChunk, None]
    ) -> AsyncGenerator[bytes, object]:
        started = _response(turn.original, meta, [], None, None)
        opening: list[_Event] = [
            LifecycleEvent(type="response.created", response=started),
            LifecycleEvent(type="response.in_progress", response=started),
        ]
        output, finish, usage = _StreamedOutput(self._tools(turn), _text_call(turn)), "stop", None
        async with aclosing(chunks):
            async for chunk in chunks:  # hot loop: one write per chunk
                events, opening = opening, []
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    events += output.feed(choice.delta, choice.logprobs)
                    finish = choice.finish_reason or finish
                if events:
                    yield self._frames(events)
        events = opening + output.close("incomplete" if finish in _INCOMPLETE else "completed")
        response = _response(turn.original, meta, output.items, _usage(usage), finish)
        self._keep(turn, response)
        yield self._frames([*events, LifecycleEvent(type=f"response.{response.status}", response=response)])

    def error_frame(self, error: GatewayError) -> bytes:
        return self._frames([ErrorEvent(type="error", code=error.code, message=error.message, param=error.param)])

    def _tools(self, turn: Turn[ResponsesRequest]) -> AgentTools:
        """The request's tools, to name the model's calls (the request was checked already)."""
        return agent_tools(turn.original.tools, "drop")

    def _keep(self, turn: Turn[ResponsesRequest], response: Response) -> None:
        if self._store is None or turn.original.store is False:
            return
        carried = without_instructions(turn.original.instructions, turn.chat.messages)  # not carried
        self._store.put(self._owner, response.id, _encode(response), [*carried, _assistant(response.output)])


def _text_call(turn: Turn[ResponsesRequest]) -> Callee | None:
    """The forced custom tool whose call is this turn's text, when its grammar was enforced
    (`forced_constraint` turned the chat request's `tool_choice` to `none`)."""
    choice = turn.original.tool_choice
    if turn.chat.tool_choice != "none" or not isinstance(choice, NamedChoice) or choice.type != "custom":
        return None
    return Callee(choice.name or "", choice.namespace, custom=True)
