"""Responses `input` items as the chat messages of a conversation.

Messages keep their roles (a developer message is a system one; the leading ones are one system
turn), calls join the assistant message before them, tool outputs are tool messages, and a
reasoning item becomes the reasoning of the assistant turn it precedes. A namespace's or custom
tool's call is the chat call the model made (`gateway.apis.agent_tools`).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from wire.openai_schema import ChatMessageParam, FunctionCall, ToolCall
from gateway.apis.agent_tools import custom_arguments, flat_name
from gateway.edge.errors import InvalidRequest

_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "refusal", "reasoning_text", "summary_text"})


class ContentPart(Struct, omit_defaults=True):
    """A text part of a message, of a function call's output or of a reasoning item."""

    type: str
    text: str | None = None
    refusal: str | None = None

    def __post_init__(self) -> None:
        if self.type in _MEDIA_PARTS:
            raise ValueError(f"content parts of type '{self.type}' are not supported: only text is")
        if self.type not in _TEXT_PARTS:
            raise ValueError(f"unknown content part type '{self.type}'")

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class OutputPart(Struct, omit_defaults=True):
    """A part of a tool's output. An image or file in it (Codex's `view_image` sends one) is
    a line saying it was left out: the model reads text only, and refusing the output would
    end the agent's run."""

    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type not in _MEDIA_PARTS and self.type not in _TEXT_PARTS:
            raise ValueError(f"unknown content part type '{self.type}'")

    @property
    def value(self) -> str:
        if self.type in _MEDIA_PARTS:
            return f"[{self.type.removeprefix('input_')} left out: this model reads text only]"
        return self.text or ""


_ITEM_FIELDS: dict[str, tuple[str, ...]] = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("output",),  # its call_id may be left out: see Conversation
    "custom_tool_call": ("call_id", "name", "input"),
    "custom_tool_call_output": ("call_id", "output"),
    "reasoning": (),
}
"""The input item kinds served, and the fields each must have."""


class InputItem(Struct, kw_only=True, omit_defaults=True):
    """One `input` item. One flat Struct, not a tagged union: a message may leave out its
    `type`, and msgspec's tagged unions cannot default a missing tag."""

    type: str = "message"
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None  # a message's; a reasoning item's reasoning_text
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a call of a namespace's tool, and (Codex) its output
    arguments: str | None = None
    input: str | None = None  # a custom tool call's
    output: str | list[OutputPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None  # OpenAI's models' reasoning, unreadable here: ignored

    def __post_init__(self) -> None:
        required = _ITEM_FIELDS.get(self.type)
        if required is None:
            raise ValueError(f"input items of type '{self.type}' are not supported")
        for name in required:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} item needs `{name}`")


class Conversation:
    """Input items as chat messages: function calls join the assistant message right before
    them, and a reasoning item waits for the assistant turn it precedes.

    A namespace's or custom tool's call is the chat call the model made: its flattened name,
    a custom tool's input as the `input` argument. A `function_call_output` without `call_id`
    (Codex sends one, with `name` and `namespace`, after its goal tools) answers the latest
    call of that tool that has no output yet; one that matches none still reaches the model,
    as a tool turn carrying the tool's name."""

    def __init__(self, messages: list[ChatMessageParam]) -> None:
        self.messages = messages
        self._reasoning: str | None = None
        self._unanswered: list[ToolCall] = [
            call for message in messages if message.role == "assistant" for call in message.tool_calls or ()
        ]

    def add(self, items: list[InputItem]) -> list[ChatMessageParam]:
        for index, item in enumerate(items):
            if item.type == "reasoning":
                self._reasoning = _reasoning_text(item)
            elif item.type in ("function_call", "custom_tool_call"):
                self._call(_tool_call(item))
            elif item.type in ("function_call_output", "custom_tool_call_output"):
                self._append(self._output(item, index))
            else:
                self._append(_item_message(item))
        return self.messages  # reasoning that no assistant turn follows is dropped

    def _append(self, message: ChatMessageParam) -> None:
        if message.role == "assistant" and self._reasoning is not None:
            message.reasoning = self._reasoning
        self._reasoning = None
        self.messages.append(message)

    def _call(self, call: ToolCall) -> None:
        self._unanswered.append(call)
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant":
            self._append(ChatMessageParam(role="assistant", content="", tool_calls=[call]))
            return
        # A copy, not an edit: the last message may belong to a stored conversation.
        reasoning = last.reasoning if last.reasoning or self._reasoning is None else self._reasoning
        calls = [*(last.tool_calls or ()), call]
        self.messages[-1] = msgspec.structs.replace(last, tool_calls=calls, reasoning=reasoning)
        self._reasoning = None

    def _output(self, item: InputItem, index: int) -> ChatMessageParam:
        content = text_of(item.output)
        if item.call_id is not None:
            self._unanswered = [call for call in self._unanswered if call.id != item.call_id]
            return ChatMessageParam(role="tool", tool_call_id=item.call_id, content=content)
        if item.name is None:
            raise InvalidRequest(
                "a function_call_output needs `call_id` (or the `name` of the call it answers)",
                param=f"input[{index}].call_id",
            )
        name = flat_name(item.name, item.namespace)
        for call in reversed(self._unanswered):
            if call.function.name == name:
                self._unanswered.remove(call)
                return ChatMessageParam(role="tool", tool_call_id=call.id, content=content)
        return ChatMessageParam(role="tool", name=name, content=content)


def _tool_call(item: InputItem) -> ToolCall:
    name = flat_name(item.name or "", item.namespace)
    arguments = custom_arguments(item.input or "") if item.type == "custom_tool_call" else item.arguments or ""
    return ToolCall(id=item.call_id or "", function=FunctionCall(name, arguments))


def _item_message(item: InputItem) -> ChatMessageParam:
    role = "system" if item.role == "developer" else item.role or "user"
    return ChatMessageParam(role=role, content=text_of(item.content))


_SYSTEM_JOIN = "\n\n"


def one_system_turn(messages: list[ChatMessageParam]) -> list[ChatMessageParam]:
    """Leading system and developer messages as one system turn, their texts in order with a
    blank line between: most chat templates take one system message, and only first (Codex
    starts with two developer messages). Later ones stay where they are."""
    leading = 0
    while leading < len(messages) and messages[leading].role == "system":
        leading += 1
    if leading < 2:
        return messages
    text = _SYSTEM_JOIN.join(str(message.content or "") for message in messages[:leading])
    return [ChatMessageParam(role="system", content=text), *messages[leading:]]


def with_instructions(instructions: str | None, messages: list[ChatMessageParam]) -> list[ChatMessageParam]:
    """`instructions` first, in the one system turn."""
    if not instructions:
        return messages
    if messages and messages[0].role == "system":
        return [
            ChatMessageParam(role="system", content=instructions + _SYSTEM_JOIN + str(messages[0].content or "")),
            *messages[1:],
        ]
    return [ChatMessageParam(role="system", content=instructions), *messages]


def without_instructions(instructions: str | None, messages: list[ChatMessageParam]) -> list[ChatMessageParam]:
    """What `with_instructions` was given (a stored conversation carries no instructions)."""
    if not instructions or not messages or messages[0].role != "system":
        return messages
    text = str(messages[0].content or "")
    if text == instructions:
        return messages[1:]
    rest = text.removeprefix(instructions + _SYSTEM_JOIN)
    return [ChatMessageParam(role="system", content=rest), *messages[1:]]


def text_of(content: str | list[ContentPart] | list[OutputPart] | None) -> str:
    """Text parts joined, as vLLM joins them for chat templates that take a string."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.value for part in content)


def _reasoning_text(item: InputItem) -> str | None:
    """The reasoning's own text, else its summary (all a client of OpenAI's models has)."""
    return text_of(item.content) or "\n\n".join(part.value for part in item.summary or ()) or None
