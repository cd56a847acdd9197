"""Chat chunks → Anthropic's Messages events; a chat completion → a Message.

The chat derender (`derender.chat`) has parsed the model's output into thinking, text and
tool calls; this writes them as Anthropic does:

    message_start                                    (with the first chunk)
    (content_block_start
     content_block_delta*                            one block open at a time, a new one
     content_block_stop)*                            whenever the kind changes: thinking,
    message_delta  {stop_reason, stop_sequence}      text, one tool_use per call
    message_stop

The engine runs it on the `derender` route (the gateway relays its bytes), the gateway on
the others (`wire.protocol.MessagesPresent` says what the answer needs of the request).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from wire.messages import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorObject,
    ErrorResponse,
    Event,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessagesUsage,
    MessageStart,
    MessageStop,
    SignatureDelta,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    error_type,
)
from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    DeltaToolCall,
    Usage,
    random_uuid,
)
from wire.protocol import MessagesPresent

_encode = msgspec.json.Encoder().encode
_ARGUMENTS_DECODER = msgspec.json.Decoder()


class MessagesAssembler:
    """One answer's Anthropic events as SSE frames (`feed` each chat chunk, then `end`), or its
    whole Message (`whole`). `prompt_tokens`: the prompt's length, for `message_start`'s usage."""

    def __init__(self, present: MessagesPresent, prompt_tokens: int) -> None:
        self._present = present
        self._prompt_tokens = prompt_tokens
        self._context: dict[str, Any] | UnsetType = (
            UNSET if present.context_management is None else present.context_management
        )
        self._blocks = _Blocks()
        self._started = False

    def feed(self, chunk: ChatCompletionChunk) -> bytes:  # hot: once per chunk
        out = self._start()
        self._blocks.feed(chunk, out)
        return b"".join(out)

    def end(self) -> bytes:
        """The events that close the open block and the message."""
        out = self._start()
        blocks = self._blocks
        blocks.close(out)
        stop = _stop(blocks.finish, blocks.matched, self._present.stop_sequences, bool(blocks.tools))
        out.append(_frame(MessageDelta(stop, _usage(blocks.usage, self._prompt_tokens), self._context)))
        out.append(_frame(MessageStop()))
        return b"".join(out)

    def whole(self, completion: ChatCompletion) -> Message:
        choice = completion.choices[0]
        content = _content(choice.message)
        called = any(isinstance(block, ToolUseBlock) for block in content)
        stop = _stop(choice.finish_reason, choice.stop_reason, self._present.stop_sequences, called)
        return Message(
            id=self._present.id,
            model=self._present.model,
            content=content,
            stop_reason=stop.stop_reason,
            stop_sequence=stop.stop_sequence,
            usage=_usage(completion.usage, self._prompt_tokens),
            context_management=self._context,
        )

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        present = self._present
        usage = MessagesUsage(self._prompt_tokens, 0, 0, 0)
        return [_frame(MessageStart(Message(id=present.id, model=present.model, content=[], usage=usage)))]


def error_frame(status: int, message: str) -> bytes:
    """The `error` event that ends a stream that failed after its first event."""
    body = _encode(ErrorResponse(ErrorObject(error_type(status), message)))
    return b"event: error\ndata: " + body + b"\n\n"


def _frame(event: Event) -> bytes:
    return b"event: " + str(event.__struct_config__.tag).encode() + b"\ndata: " + _encode(event) + b"\n\n"


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
