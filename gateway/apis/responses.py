"""OpenAI's Responses API (`POST /v1/responses`) as a chat completion.

`decode_request` reads the request (what is not served is refused by name), `to_chat` turns
it into the chat request the pipeline runs, and `ResponsesPresenter` gives the answer its
shape: the Response as it starts (the request's settings echoed), from which the Responses
assembler (`derender.responses`) writes the events or the whole Response, on the engine (the
`derender` route: the gateway relays its bytes) or here (the other routes, from chat chunks).

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
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from derender.responses import ResponsesAssembler
from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageParam,
    FunctionCall,
    Int64,
    NamedFunction,
    NamedToolChoice,
    ReasoningEffort,
    ToolCall,
    ToolChoice,
)
from wire.protocol import Callee, ResponsesPresent
from wire.responses import (
    FINAL_TYPES,
    CustomToolCallItem,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    ReasoningItem,
    ResponseUsage,
)
from gateway.apis.agent_tools import (
    HOSTED_TYPES,
    AgentTools,
    Tool,
    ToolPolicy,
    agent_tools,
    checked_tools,
    custom_arguments,
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


_ECHOED = (
    "instructions", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt_cache_key", "reasoning",
    "safety_identifier", "temperature", "top_p", "user",
)
"""Request fields a Response repeats as they were sent."""


def _started(request: ResponsesRequest, meta: Presented) -> Response:
    """The Response as it starts: what the answer fills in (`derender.responses`) is still empty."""
    return Response(
        id=meta.response_id, created_at=meta.created, status="in_progress", model=meta.model,
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


# ------------------------------------------------------------ presenter


class ResponsesPresenter:
    """Chat answers as Responses (`gateway.apis.translate.Presenter`), one presenter per request;
    a finished response is stored unless the request says `store: false`."""

    final_events: tuple[str, ...] = FINAL_TYPES

    def __init__(self, store: ResponseStorage | None, owner: str) -> None:
        self._store, self._owner = store, owner
        self._assembler: ResponsesAssembler | None = None
        """The stream's, when it is assembled here: it numbers the error event too."""

    def present(self, turn: Turn[ResponsesRequest], meta: Presented) -> ResponsesPresent:
        tools = agent_tools(turn.original.tools, "drop")  # to name the model's calls (checked already)
        started = msgspec.to_builtins(_started(turn.original, meta))
        return ResponsesPresent(response=started, callees=tools.callees, text_call=_text_call(turn))

    async def whole(self, turn: Turn[ResponsesRequest], meta: Presented, completion: ChatCompletion) -> dict[str, Any]:
        response = ResponsesAssembler(self.present(turn, meta)).whole(completion)
        await self._keep(turn, meta.response_id, _encode(response), response["output"])
        return response

    async def stream(
        self, turn: Turn[ResponsesRequest], meta: Presented, chunks: AsyncGenerator[ChatCompletionChunk, None]
    ) -> AsyncGenerator[bytes, object]:
        assembler = self._assembler = ResponsesAssembler(self.present(turn, meta))
        async with aclosing(chunks):
            async for chunk in chunks:  # hot loop: one write per chunk
                if out := assembler.feed(chunk):
                    yield out
        out = assembler.end()
        response = assembler.response
        assert response is not None  # `end` made it
        await self._keep(turn, meta.response_id, _encode(response), response["output"])
        yield out

    async def relayed(self, turn: Turn[ResponsesRequest], meta: Presented, final: bytes) -> None:
        """The engine assembled the answer (the `derender` route): `final` is its Response, or
        the data of its last event, which holds it."""
        if self._store is None or turn.original.store is False:
            return
        if final.startswith(b'{"type":"response.'):
            final = bytes(_FINAL_EVENT.decode(final).response)
        kept = _KEPT.decode(final)
        await self._keep(turn, meta.response_id, final, kept.output)

    def error_frame(self, error: GatewayError, sequence: int | None = None) -> bytes:
        """`sequence`: the error event's number, when the events before it were not numbered here."""
        if sequence is None:
            sequence = self._assembler.sequence if self._assembler is not None else 0
        event = ErrorEvent(type="error", code=error.code, message=error.message, param=error.param)
        event.sequence_number = sequence
        return b"event: error\ndata: " + _encode(event) + b"\n\n"

    async def _keep(
        self, turn: Turn[ResponsesRequest], response_id: str, response: bytes, output: list[OutputItem]
    ) -> None:
        """Stored before the client sees the end of the answer, so that it may continue it at
        once; a store that cannot take it raises `StateUnavailable` (a 503, or a stream's error event)."""
        if self._store is None or turn.original.store is False:
            return
        carried = without_instructions(turn.original.instructions, turn.chat.messages)  # not carried
        await self._store.put(self._owner, response_id, response, [*carried, _assistant(output)])


class _FinalEvent(Struct):
    response: msgspec.Raw


class _Kept(Struct):
    """What the store needs of a finished Response besides its bytes."""

    output: list[OutputItem]


_FINAL_EVENT = msgspec.json.Decoder(_FinalEvent)
_KEPT = msgspec.json.Decoder(_Kept)


def _text_call(turn: Turn[ResponsesRequest]) -> Callee | None:
    """The forced custom tool whose call is this turn's text, when its grammar was enforced
    (`forced_constraint` turned the chat request's `tool_choice` to `none`)."""
    choice = turn.original.tool_choice
    if turn.chat.tool_choice != "none" or not isinstance(choice, NamedChoice) or choice.type != "custom":
        return None
    return Callee(choice.name or "", choice.namespace, custom=True)
