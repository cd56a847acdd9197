"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a chat completion.

`to_chat` turns the request into the chat request the pipeline runs; `MessagesPresenter`
says what the answer needs of the request, from which the Messages assembler
(`derender.messages`) writes Anthropic's events or the whole Message, on the engine (the
`derender` route: the gateway relays its bytes) or here (the other routes, from chat chunks).

Names follow the `anthropic` SDK's types. An unknown top-level request field is ignored or
refused by name, as `agents.unknown_fields` says (`gateway.edge.unknown_fields`); blocks, tools and
the small config objects are not, because clients send back the blocks of earlier answers
with fields Anthropic keeps adding (`citations`, `caller`, `cache_control`), none of which
changes what a self-hosted model is asked. `context_management` edits the conversation first
(`gateway.apis.context_edits`); tools with a `type` are Anthropic's (`gateway.apis.anthropic_tools`).
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageParam,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolChoice as ChatToolChoice,
)
from derender.messages import MessagesAssembler
from wire.messages import (
    ErrorObject,
    ErrorResponse,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Typed,
    error_type,
)
from wire.protocol import MessagesPresent
from gateway.apis.anthropic_tools import CLIENT_TOOLS, hosted_label, is_computer
from gateway.config import Agents
from gateway.apis.context_edits import (
    CLEARED,
    AppliedEdit,
    ContextManagement,
    Edit,
    EditError,
    Plain,
    decode_edits,
    plan,
)
from gateway.edge.errors import CONTEXT_LENGTH_EXCEEDED, GatewayError, InvalidRequest
from gateway.apis.translate import Presented, Turn
from gateway.edge.unknown_fields import Decoded, TolerantDecoder

# ------------------------------------------------------------ content blocks, in and out


class ImageBlock(Typed, tag="image"):
    """Refused: onehop serves text models."""


class DocumentBlock(Typed, tag="document"):
    """Refused, as images are."""


class RedactedThinkingBlock(Typed, tag="redacted_thinking"):
    """Dropped: Anthropic's encrypted reasoning means nothing to another model."""


class ToolResultBlock(Typed, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False  # the text says what went wrong; chat has no flag for it


Block = TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock

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
    type: str | None = None  # "custom" or absent; else one of Anthropic's (`gateway.apis.anthropic_tools`)
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
    context_management: ContextManagement | None = None
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
    # OpenAI's and vLLM's sampling fields, as on chat (`SAMPLING_EXTRAS`; checked there).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # Accepted, not acted on (Claude Code's `user_id` is a JSON string naming its session).
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
    if unknown is not None:  # the top level, or a strict config object (`context_management`)
        name = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return InvalidRequest(f"{name}: Extra inputs are not permitted", param=name)
    if missing is not None:
        name = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return InvalidRequest(f"{name}: Field required", param=name)
    if (tag := _BAD_TAG.match(text)) is not None:  # a block kind not listed in `Block`
        return InvalidRequest(f"{path}: {tag.group(1)!r} blocks are not supported", param=path)
    return InvalidRequest(f"invalid Messages request: {text}", param=path or None)


# ------------------------------------------------------------ request → chat request


SAMPLING_EXTRAS = (
    "frequency_penalty", "presence_penalty", "seed", "logit_bias", "min_p", "repetition_penalty", "min_tokens",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "bad_words", "allowed_token_ids",
)
"""Chat's sampling fields beyond Anthropic's own, passed on when set (benchmarks send `ignore_eos`)."""
ATTRIBUTION = "x-anthropic-billing-header:"
"""How Claude Code's attribution line starts: it names the release and conversation, so it differs
between conversations and, first in the system prompt, would leave them no shared prefix."""
_AGENTS = Agents()


class ContextManagementResponse(Struct):
    applied_edits: list[AppliedEdit]


@dataclass(frozen=True, slots=True)
class Translated:
    """A Messages request as the chat request it runs as, and what the translation left out."""

    chat: ChatCompletionRequest
    applied: ContextManagementResponse | None
    """The edits `context_management` made (None: the request sent none), for the answer."""
    ignored_edits: tuple[str, ...] = ()
    """Edit types not served, ignored."""
    dropped_tools: tuple[str, ...] = ()
    """Server tools left out of the prompt, by type."""


def count_tokens_to_chat(request: CountTokensRequest, agents: Agents = _AGENTS) -> ChatCompletionRequest:
    return ChatCompletionRequest(**_prompt(request, agents)[0])


def to_chat(request: MessagesRequest, agents: Agents = _AGENTS) -> ChatCompletionRequest:
    return translate(request, agents).chat


def translate(request: MessagesRequest, agents: Agents = _AGENTS) -> Translated:
    for name in ("container", "mcp_servers"):
        if getattr(request, name) is not None:
            raise InvalidRequest(f"{name}: not served by this gateway", param=name)
    fields, notes = _prompt(request, agents)
    extras = {name: value for name in SAMPLING_EXTRAS if (value := getattr(request, name)) is not None}
    chat = ChatCompletionRequest(
        **fields,
        **extras,
        max_completion_tokens=request.max_tokens,
        stop=request.stop_sequences or [],
        stream=bool(request.stream),
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
    )
    return Translated(chat, *notes)


_Notes = tuple[ContextManagementResponse | None, tuple[str, ...], tuple[str, ...]]
"""`Translated`'s fields after `chat`."""


def _prompt(request: CountTokensRequest, agents: Agents) -> tuple[dict[str, Any], _Notes]:
    """The chat fields that shape the prompt (all a token count needs), and what was left out."""
    tools, dropped = _tools(request.tools or [], agents.hosted_tools)
    system = _system(_strip_attribution(request.system) if agents.strip_attribution else request.system)
    edits, ignored = _edits(request.context_management)
    outside = _chars(system, tools) if edits else 0
    conversation, applied = _messages(request.messages, edits, outside)
    messages = system + conversation
    choice = request.tool_choice
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
    }
    kwargs: dict[str, Any] = {}
    if request.thinking is not None:  # absent: the model's own default; "adaptive" is on
        kwargs["enable_thinking"] = request.thinking.type != "disabled"
        fields["include_reasoning"] = request.thinking.display != "omitted"
    if request.output_config is not None:
        fields.update(_output_config(request.output_config))
    if "reasoning_effort" in fields:  # what gpt-oss's template reads, as vLLM passes it
        kwargs["reasoning_effort"] = fields["reasoning_effort"]
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    if messages and messages[-1].role == "assistant":  # a prefill: the answer continues it
        fields.update(continue_final_message=True, add_generation_prompt=False)
    response = None if request.context_management is None else ContextManagementResponse(applied)
    return fields, (response, tuple(ignored), tuple(dropped))


def _chars(system: list[ChatMessageParam], tools: list[ChatTool] | None) -> int:
    """The text outside the conversation that the prompt holds too."""
    return sum(len(m.content) for m in system if isinstance(m.content, str)) + len(_encode(tools or []))


def _strip_attribution(system: str | list[TextBlock] | None) -> str | list[TextBlock] | None:
    """Claude Code's attribution line left out: the first system block that starts with it
    goes, or only that line when the block holds more."""
    if isinstance(system, str):
        return _without_first_line(system) if system.startswith(ATTRIBUTION) else system
    for i, block in enumerate(system or ()):
        if block.text.startswith(ATTRIBUTION):
            rest = _without_first_line(block.text)
            kept = [TextBlock(rest)] if rest.strip() else []
            return [*system[:i], *kept, *system[i + 1 :]]  # type: ignore[index]
    return system


def _without_first_line(text: str) -> str:
    return text.partition("\n")[2]


def _system(system: str | list[TextBlock] | None) -> list[ChatMessageParam]:
    text = system if isinstance(system, str) else "\n".join(block.text for block in system or ())
    return [ChatMessageParam(role="system", content=text)] if text else []


def _edits(config: ContextManagement | None) -> tuple[list[Edit], list[str]]:
    if config is None:
        return [], []
    try:
        return decode_edits(config)
    except EditError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from exc


def _messages(
    messages: list[MessageParam], edits: list[Edit], outside: int
) -> tuple[list[ChatMessageParam], list[AppliedEdit]]:
    """The conversation as chat messages, edited as `edits` say (`outside`: the characters of
    the system prompt and tools, which the token trigger counts too)."""
    _check_blocks(messages)
    turns = _turns(messages)
    applied: list[AppliedEdit] = []
    if edits:
        turns, applied = _edited(turns, edits, outside)
    out: list[ChatMessageParam] = []
    for role, blocks in turns:
        if role == "user":
            out += _user(blocks)
        elif role == "assistant":
            out.append(_assistant(blocks))
        else:  # a system message mid-conversation, rendered where it is
            out.append(ChatMessageParam(role="system", content="\n".join(_texts(blocks))))
    return out, applied


def _edited(
    turns: list[tuple[str, list[Block]]], edits: list[Edit], outside: int
) -> tuple[list[tuple[str, list[Block]]], list[AppliedEdit]]:
    changes = plan(edits, [(role, [_plain(block) for block in blocks]) for role, blocks in turns], outside)
    edited: list[tuple[str, list[Block]]] = []
    for i, (role, blocks) in enumerate(turns):
        kept: list[Block] = []
        for block in blocks:
            if isinstance(block, ThinkingBlock | RedactedThinkingBlock) and i in changes.thinking_turns:
                continue
            if isinstance(block, ToolResultBlock) and block.tool_use_id in changes.cleared_results:
                block = msgspec.structs.replace(block, content=CLEARED)
            elif isinstance(block, ToolUseBlock) and block.id in changes.cleared_inputs:
                block = msgspec.structs.replace(block, input={})
            kept.append(block)
        edited.append((role, kept))
    return edited, changes.applied


def _plain(block: Block) -> Plain:
    if isinstance(block, ThinkingBlock):
        return Plain("thinking", len(block.thinking))
    if isinstance(block, ToolUseBlock):
        return Plain("tool_use", len(_encode(block.input)), block.id, block.name)
    if isinstance(block, ToolResultBlock):
        return Plain("tool_result", len(_result_text(block.content)), block.tool_use_id)
    return Plain("other", len(block.text) if isinstance(block, TextBlock) else 0)


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
        blocks: list[Block] = (
            [TextBlock(message.content)] if isinstance(message.content, str) else list(message.content)
        )
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


def _tools(tools: list[Tool], hosted: str) -> tuple[list[ChatTool] | None, list[str]]:
    """The function tools the model sees, and the types of the server tools left out."""
    out: list[ChatTool] = []
    dropped: list[str] = []
    for index, tool in enumerate(tools):
        kind = tool.type
        if kind is None or kind == "custom":
            out.append(_custom_tool(index, tool))
        elif kind in CLIENT_TOOLS:  # run by the client: a function tool with Anthropic's schema
            description, schema = CLIENT_TOOLS[kind]
            out.append(
                ChatTool(
                    function=FunctionDefinition(
                        name=tool.name, description=tool.description or description, parameters=schema
                    )
                )
            )
        elif is_computer(kind):
            raise InvalidRequest(
                f"tools[{index}].type: {kind!r} is not served: computer use works from screenshots,"
                " and media is not served",
                param=f"tools[{index}].type",
            )
        elif hosted == "refuse":
            raise InvalidRequest(
                f"tools[{index}].type: the server tool {kind!r} ({tool.name}) runs on Anthropic's servers and is not "
                "served here (agents.hosted_tools: refuse)",
                param=f"tools[{index}].type",
            )
        else:
            dropped.append(hosted_label(kind))
    return out or None, dropped


def _custom_tool(index: int, tool: Tool) -> ChatTool:
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
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": config.format.schema},
        }
    return fields


# ------------------------------------------------------------ answers and events


def error_body(error: GatewayError) -> bytes:
    message = too_long(error.message) if error.code == CONTEXT_LENGTH_EXCEEDED else error.message
    return _encode(ErrorResponse(ErrorObject(error_type(error.status), message)))


_MAXIMUM = re.compile(r"maximum context length is (\d+) tokens")
_PROMPT = re.compile(r"(\d+) input tokens|request has (\d+) tokens|\((\d+) in the messages")
_CHARS = re.compile(r"contains (\d+) characters \(more than (\d+) characters")


def too_long(message: str) -> str:
    """A prompt over the context in Anthropic's words, `prompt is too long: N tokens > M maximum`,
    which Anthropic's clients look for (Claude Code compacts its conversation on it). The
    gateway's and vLLM's messages give both numbers; a prompt refused by its length in
    characters before render gives the fewest tokens it can hold (its characters over the
    vocabulary's longest token)."""
    maximum = _MAXIMUM.search(message)
    if maximum is None:
        return f"prompt is too long: {message}"
    most = int(maximum.group(1))
    if (chars := _CHARS.search(message)) is not None:
        tokens = math.ceil(int(chars.group(1)) * most / int(chars.group(2)))
    elif (prompt := _PROMPT.search(message)) is not None:
        tokens = int(next(group for group in prompt.groups() if group is not None))
    else:
        return f"prompt is too long: {message}"
    return f"prompt is too long: {tokens} tokens > {most} maximum"


class MessagesPresenter:
    """Chat answers as Anthropic's (`gateway.apis.translate.Presenter`): what the answer needs of
    the request, for the Messages assembler (`derender.messages`) on the engine or here.
    `context` is what the request's `context_management` did (None when it sent none)."""

    final_events: tuple[str, ...] = ()

    def __init__(self, context: ContextManagementResponse | None = None) -> None:
        self._context = None if context is None else msgspec.to_builtins(context)

    def present(self, turn: Turn[MessagesRequest], meta: Presented) -> MessagesPresent:
        return MessagesPresent(
            id=meta.response_id,
            model=meta.model,
            stop_sequences=turn.original.stop_sequences or [],
            context_management=self._context,
        )

    async def whole(self, turn: Turn[MessagesRequest], meta: Presented, completion: ChatCompletion) -> Message:
        return MessagesAssembler(self.present(turn, meta), meta.prompt_tokens).whole(completion)

    async def stream(
        self, turn: Turn[MessagesRequest], meta: Presented, chunks: AsyncGenerator[ChatCompletionChunk, None]
    ) -> AsyncGenerator[bytes, object]:
        assembler = MessagesAssembler(self.present(turn, meta), meta.prompt_tokens)
        async with aclosing(chunks):
            async for chunk in chunks:  # hot loop: one write per chunk
                if out := assembler.feed(chunk):
                    yield out
        yield assembler.end()

    async def relayed(self, turn: Turn[MessagesRequest], meta: Presented, final: bytes) -> None:
        """Nothing is kept of a Message."""

    def error_frame(self, error: GatewayError, sequence: int | None = None) -> bytes:
        return b"event: error\ndata: " + error_body(error) + b"\n\n"
