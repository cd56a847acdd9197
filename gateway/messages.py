"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a chat completion.

`to_chat` turns the request into the chat request the pipeline runs; `MessagesPresenter`
turns the chat answer back into a `Message`, or the chat chunks into Anthropic's events:

    message_start                                    (after the first chunk: an engine that
    (content_block_start                              fails before it gets an HTTP status)
     content_block_delta*                            one block open at a time, a new one
     content_block_stop)*                            whenever the kind changes: thinking,
    message_delta  {stop_reason, stop_sequence}      text, one tool_use per call
    message_stop

Names follow the `anthropic` SDK's types. An unknown top-level request field is ignored or
refused by name, as `agents.unknown_fields` says (`gateway.unknown_fields`); blocks, tools and the small config objects are not, because clients
send back the blocks of earlier answers with fields Anthropic keeps adding (`citations`,
`caller`, `cache_control`), none of which changes what a self-hosted model is asked.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from engine.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatMessageParam,
    ChatTool,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolChoice as ChatToolChoice,
    Usage,
    random_uuid,
)
from gateway.errors import GatewayError, InvalidRequest
from gateway.translate import Presented, Turn
from gateway.unknown_fields import Decoded, TolerantDecoder

# ------------------------------------------------------------ content blocks, in and out


class _Typed(Struct, tag_field="type"):
    """A block or event whose `type` names its kind (written first)."""


class TextBlock(_Typed, tag="text"):
    text: str


class ImageBlock(_Typed, tag="image"):
    """Refused: onehop serves text models."""


class DocumentBlock(_Typed, tag="document"):
    """Refused, as images are."""


class ThinkingBlock(_Typed, tag="thinking"):
    thinking: str
    signature: str = ""  # ours are empty: nothing here checks one


class RedactedThinkingBlock(_Typed, tag="redacted_thinking"):
    """Dropped: Anthropic's encrypted reasoning means nothing to another model."""


class ToolUseBlock(_Typed, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Typed, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False  # the text says what went wrong; chat has no flag for it


Block = TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock
ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock
"""What an answer holds."""

_MEDIA = (ImageBlock, DocumentBlock)
_ALLOWED: dict[str, tuple[type, ...]] = {
    "user": (TextBlock, ToolResultBlock),
    "assistant": (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock),
    "system": (TextBlock,),  # SDK 2.16's MessageParam has a system role
}

# ------------------------------------------------------------ requests


class MessageParam(Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; anything else is a server tool, refused
    strict: bool | UnsetType = UNSET


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    # Accepted, not acted on: the gateway refuses vLLM's thinking_token_budget; max_tokens bounds it.
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`/v1/messages/count_tokens`: what shapes the prompt, nothing that samples."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted, not acted on: the engine caches prefixes by itself; speed is a deployment's.
    cache_control: dict[str, Any] | None = None
    speed: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    # Not in SDK 2.16's params any more, still sent by most clients; Anthropic's range.
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: float | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    # Accepted, not acted on.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    # Refused when set: onehop runs no containers and calls no MCP servers.
    container: str | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None


class _LenientMessagesRequest(MessagesRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


class _LenientCountTokensRequest(CountTokensRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


_REQUEST_DECODER = TolerantDecoder(MessagesRequest, _LenientMessagesRequest)
_COUNT_DECODER = TolerantDecoder(CountTokensRequest, _LenientCountTokensRequest)
_ARGUMENTS_DECODER = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_BAD_TAG = re.compile(r"Invalid value '([^']*)'")


def decode_request(body: bytes, *, ignore_unknown: bool = True) -> Decoded[MessagesRequest]:
    return _decode(_REQUEST_DECODER, body, ignore_unknown)


def decode_count_tokens_request(body: bytes, *, ignore_unknown: bool = True) -> Decoded[CountTokensRequest]:
    return _decode(_COUNT_DECODER, body, ignore_unknown)


def _decode(decoder: TolerantDecoder[Any], body: bytes, ignore_unknown: bool) -> Decoded[Any]:
    try:
        return decoder.decode(body, ignore_unknown=ignore_unknown)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("the body nests too deeply") from exc


def _invalid(text: str) -> InvalidRequest:
    """msgspec's error, in Anthropic's words where it has some (`<field>: Field required`)."""
    at = _AT.search(text)
    path = at.group(1) if at else ""
    unknown, missing = _UNKNOWN.match(text), _MISSING.match(text)
    if unknown is not None and not path:  # nested objects ignore unknown fields: only the top level
        return InvalidRequest(f"{unknown.group(1)}: Extra inputs are not permitted", param=unknown.group(1))
    if missing is not None:
        name = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return InvalidRequest(f"{name}: Field required", param=name)
    if (tag := _BAD_TAG.match(text)) is not None:  # a block kind not listed in `Block`
        return InvalidRequest(f"{path}: {tag.group(1)!r} blocks are not supported", param=path)
    return InvalidRequest(f"invalid Messages request: {text}", param=path or None)


# ------------------------------------------------------------ request → chat request


def count_tokens_to_chat(request: CountTokensRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest(**_prompt_fields(request))


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    for name in ("container", "mcp_servers"):
        if getattr(request, name) is not None:
            raise InvalidRequest(f"{name}: not served by this gateway", param=name)
    return ChatCompletionRequest(
        **_prompt_fields(request),
        max_completion_tokens=request.max_tokens,
        stop=request.stop_sequences or [],
        stream=bool(request.stream),
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
    )


def _prompt_fields(request: CountTokensRequest) -> dict[str, Any]:
    """The chat fields that shape the prompt (all a token count needs)."""
    messages = _system(request.system) + _messages(request.messages)
    choice = request.tool_choice
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": [_tool(i, tool) for i, tool in enumerate(request.tools)] if request.tools else None,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
    }
    if request.thinking is not None:  # absent: the model's own default
        fields["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
        fields["include_reasoning"] = request.thinking.display != "omitted"
    if request.output_config is not None:
        fields.update(_output_config(request.output_config))
    if messages and messages[-1].role == "assistant":  # a prefill: the answer continues it
        fields.update(continue_final_message=True, add_generation_prompt=False)
    return fields


def _system(system: str | list[TextBlock] | None) -> list[ChatMessageParam]:
    text = system if isinstance(system, str) else "\n".join(block.text for block in system or ())
    return [ChatMessageParam(role="system", content=text)] if text else []


def _messages(messages: list[MessageParam]) -> list[ChatMessageParam]:
    _check_blocks(messages)
    out: list[ChatMessageParam] = []
    for role, blocks in _turns(messages):
        if role == "user":
            out += _user(blocks)
        elif role == "assistant":
            out.append(_assistant(blocks))
        else:
            out.append(ChatMessageParam(role="system", content="\n".join(_texts(blocks))))
    return out


def _check_blocks(messages: list[MessageParam]) -> None:
    """Media and misplaced blocks are refused with their exact path, before turns are merged."""
    for i, message in enumerate(messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
            _check_block(f"messages[{i}].content[{j}]", message.role, block)


def _check_block(path: str, role: str, block: Block) -> None:
    parts = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else []
    for where, part in [(path, block), *((f"{path}.content[{k}]", part) for k, part in enumerate(parts))]:
        if isinstance(part, _MEDIA):
            raise InvalidRequest(f"{where}: {_kind(part)} blocks are not supported: media is not served", param=where)
    if not isinstance(block, _ALLOWED[role]):
        raise InvalidRequest(f"{path}: a {_kind(block)} block cannot be in a {role} message", param=path)


def _kind(block: Struct) -> str:
    return str(block.__struct_config__.tag)


def _turns(messages: list[MessageParam]) -> list[tuple[str, list[Block]]]:
    """Consecutive messages of one role as one turn, as Anthropic combines them (chat
    templates that insist on alternating roles would refuse them otherwise)."""
    turns: list[tuple[str, list[Block]]] = []
    for message in messages:
        blocks: list[Block] = [TextBlock(message.content)] if isinstance(message.content, str) else list(message.content)
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def _texts(blocks: list[Any]) -> list[str]:
    return [block.text for block in blocks if isinstance(block, TextBlock)]


def _user(blocks: list[Block]) -> list[ChatMessageParam]:
    """Tool results first, one tool message each (chat wants them right after the call, and
    Anthropic wants them first in the turn), then the text as one string: every chat template
    takes a string, and vLLM flattens a list of text parts with the same "\\n"."""
    out = [
        ChatMessageParam(role="tool", tool_call_id=block.tool_use_id, content=_result_text(block.content))
        for block in blocks
        if isinstance(block, ToolResultBlock)
    ]
    texts = _texts(blocks)
    if texts or not out:
        out.append(ChatMessageParam(role="user", content="\n".join(texts)))
    return out


def _result_text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "\n".join(_texts(content))


def _assistant(blocks: list[Block]) -> ChatMessageParam:
    """Text blocks joined with nothing: an answer splits its text into blocks mid-sentence."""
    reasoning = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    calls = [
        ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=_encode(block.input).decode()))
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    return ChatMessageParam(
        role="assistant", content="".join(_texts(blocks)), tool_calls=calls or UNSET, reasoning=reasoning or UNSET
    )


def _tool(index: int, tool: Tool) -> ChatTool:
    if tool.type not in (None, "custom"):
        raise InvalidRequest(
            f"tools[{index}]: the server tool {tool.type!r} ({tool.name}) is not served: only custom tools are",
            param=f"tools[{index}].type",
        )
    if tool.input_schema is None:
        raise InvalidRequest(f"tools[{index}].input_schema: Field required", param=f"tools[{index}].input_schema")
    return ChatTool(
        function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict
        )
    )


_CHOICES: dict[str, ChatToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(choice: ToolChoice | None) -> ChatToolChoice | UnsetType:
    if choice is None:
        return UNSET
    if choice.type != "tool":
        return _CHOICES[choice.type]
    if not choice.name:
        raise InvalidRequest("tool_choice.name: Field required", param="tool_choice.name")
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _output_config(config: OutputConfig) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if config.effort is not None:
        fields["reasoning_effort"] = config.effort
    if config.format is not None:  # Anthropic's structured outputs are OpenAI's json_schema
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema}}
    return fields


# ------------------------------------------------------------ answers and events


class MessagesUsage(Struct):
    """Anthropic counts cached prompt tokens apart: the three inputs add up to the prompt."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class Message(_Typed, tag="message", kw_only=True):
    id: str
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class TextDelta(_Typed, tag="text_delta"):
    text: str


class ThinkingDelta(_Typed, tag="thinking_delta"):
    thinking: str


class SignatureDelta(_Typed, tag="signature_delta"):
    signature: str


class InputJSONDelta(_Typed, tag="input_json_delta"):
    partial_json: str


class MessageStart(_Typed, tag="message_start"):
    message: Message


class ContentBlockStart(_Typed, tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(_Typed, tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


class ContentBlockStop(_Typed, tag="content_block_stop"):
    index: int


class StopInfo(Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(_Typed, tag="message_delta"):
    delta: StopInfo
    usage: MessagesUsage


class MessageStop(_Typed, tag="message_stop"):
    pass


class ErrorObject(Struct):
    type: str
    message: str


class ErrorResponse(_Typed, tag="error"):
    """Anthropic's error body, and the data of its `error` event."""

    error: ErrorObject


Event = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorResponse

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}
"""Anthropic's documented types by status; the SDK's ErrorType has `timeout_error` for a 504."""


def error_body(error: GatewayError) -> bytes:
    fallback = "invalid_request_error" if error.status < 500 else "api_error"
    return _encode(ErrorResponse(ErrorObject(_ERROR_TYPES.get(error.status, fallback), error.message)))


def _frame(event: Event) -> bytes:
    return b"event: " + _kind(event).encode() + b"\ndata: " + _encode(event) + b"\n\n"


def _text(value: object) -> str:
    """A chat field that may be UNSET, None or a string, as a string."""
    return value if isinstance(value, str) else ""


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def _stop(finish: str | None, matched: object, sequences: list[str] | None, called: bool) -> StopInfo:
    """vLLM answers a forced tool call with "stop": a call made is a `tool_use` stop either way.
    `matched` is vLLM's `stop_reason`: the stop string hit (or a stop token's id)."""
    if called and finish in ("stop", "tool_calls"):
        return StopInfo("tool_use", None)
    if finish == "stop" and isinstance(matched, str) and matched in (sequences or ()):
        return StopInfo("stop_sequence", matched)
    return StopInfo(_STOP_REASONS.get(finish or "stop", "end_turn"), None)


def _usage(usage: Usage | None, prompt_tokens: int) -> MessagesUsage:
    if usage is None:
        return MessagesUsage(prompt_tokens, 0, 0, 0)
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return MessagesUsage(usage.prompt_tokens - cached, 0, cached, usage.completion_tokens or 0)


def _tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as `input`, which must be an object: arguments a model wrote badly
    become `{}`, which the client's tool refuses as a tool_result the model can read and
    retry from, where failing the whole turn would lose the text and other calls."""
    try:
        value = _ARGUMENTS_DECODER.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _content(message: ChatCompletionMessage) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    reasoning = _text(message.reasoning) or _text(message.reasoning_content)
    if reasoning:
        blocks.append(ThinkingBlock(reasoning))
    if message.content:
        blocks.append(TextBlock(message.content))
    for call in message.tool_calls or ():
        blocks.append(ToolUseBlock(call.id, call.function.name, _tool_input(call.function.arguments)))
    return blocks


class _Blocks:
    """The content blocks of one stream. At most one is open: `kind` is "thinking", "text",
    or the chat index of the tool call whose arguments stream into it."""

    def __init__(self) -> None:
        self.count = 0
        self.kind: str | int | None = None
        self.tools: dict[int, int] = {}  # chat tool-call index → block index
        self.finish: str | None = None
        self.matched: object = None
        self.usage: Usage | None = None

    def feed(self, chunk: ChatCompletionChunk, out: list[bytes]) -> None:
        if chunk.usage is not UNSET and chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:  # one choice: a presented request asks for one
            delta = choice.delta
            reasoning = _text(delta.reasoning) or _text(delta.reasoning_content)
            if reasoning:
                self._delta("thinking", ThinkingDelta(reasoning), out)
            if content := _text(delta.content):
                self._delta("text", TextDelta(content), out)
            for call in delta.tool_calls or ():
                self._tool(call, out)
            if choice.finish_reason is not None:
                self.finish, self.matched = choice.finish_reason, choice.stop_reason

    def _delta(self, kind: str, delta: TextDelta | ThinkingDelta, out: list[bytes]) -> None:
        if self.kind != kind:
            self._open(kind, ThinkingBlock("") if kind == "thinking" else TextBlock(""), out)
        out.append(_frame(ContentBlockDelta(self.count - 1, delta)))

    def _tool(self, call: DeltaToolCall, out: list[bytes]) -> None:
        function = call.function if call.function is not UNSET and call.function is not None else None
        index = self.tools.get(call.index)
        if index is None:  # vLLM names the call (and gives its id) in its first delta
            block = ToolUseBlock(_text(call.id) or f"toolu_{random_uuid()}", _text(function and function.name), {})
            index = self.tools[call.index] = self._open(call.index, block, out)
        # A call resumed after another block opened (vLLM never does) keeps its own index.
        if arguments := _text(function and function.arguments):
            out.append(_frame(ContentBlockDelta(index, InputJSONDelta(arguments))))

    def _open(self, kind: str | int, block: ContentBlock, out: list[bytes]) -> int:
        self.close(out)
        self.kind = kind
        out.append(_frame(ContentBlockStart(self.count, block)))
        self.count += 1
        return self.count - 1

    def close(self, out: list[bytes]) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":  # Anthropic ends a thinking block with its signature
            out.append(_frame(ContentBlockDelta(self.count - 1, SignatureDelta(""))))
        out.append(_frame(ContentBlockStop(self.count - 1)))
        self.kind = None


class MessagesPresenter:
    """Chat answers as Anthropic's (`gateway.translate.Presenter`)."""

    def whole(self, turn: Turn[MessagesRequest], meta: Presented, completion: ChatCompletion) -> Message:
        choice = completion.choices[0]
        content = _content(choice.message)
        called = any(isinstance(block, ToolUseBlock) for block in content)
        stop = _stop(choice.finish_reason, choice.stop_reason, turn.original.stop_sequences, called)
        return Message(
            id=meta.response_id,
            model=meta.model,
            content=content,
            stop_reason=stop.stop_reason,
            stop_sequence=stop.stop_sequence,
            usage=_usage(completion.usage, meta.prompt_tokens),
        )

    async def stream(
        self, turn: Turn[MessagesRequest], meta: Presented, chunks: AsyncIterator[ChatCompletionChunk]
    ) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        started = False
        async with aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:  # hot loop: one write per chunk
                out = [] if started else [self._start(meta)]
                started = True
                blocks.feed(chunk, out)
                if out:
                    yield b"".join(out)
        out = [] if started else [self._start(meta)]
        blocks.close(out)
        stop = _stop(blocks.finish, blocks.matched, turn.original.stop_sequences, bool(blocks.tools))
        out.append(_frame(MessageDelta(stop, _usage(blocks.usage, meta.prompt_tokens))))
        out.append(_frame(MessageStop()))
        yield b"".join(out)

    def error_frame(self, error: GatewayError) -> bytes:
        return b"event: error\ndata: " + error_body(error) + b"\n\n"

    @staticmethod
    def _start(meta: Presented) -> bytes:
        message = Message(id=meta.response_id, model=meta.model, content=[], usage=MessagesUsage(meta.prompt_tokens, 0, 0, 0))
        return _frame(MessageStart(message))
