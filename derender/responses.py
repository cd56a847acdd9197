"""Chat chunks → OpenAI's Responses events; a chat completion → a Response.

The chat derender (`derender.chat`) has parsed the model's output into reasoning, text and
tool calls; this writes them as the Responses API does:

    response.created, response.in_progress           (with the first chunk)
    (response.output_item.added
      reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
      message:   content_part.added, output_text.delta*, output_text.done, content_part.done
      call:      function_call_arguments.delta*, function_call_arguments.done
      custom:    custom_tool_call_input.delta*, custom_tool_call_input.done
     response.output_item.done)*                     one item open at a time, a new one
    response.completed | response.incomplete         whenever the kind of delta changes

Every event has one `sequence_number` from 0, the error event included. The engine runs it
on the `derender` route (the gateway relays its bytes), the gateway on the others; either
way the Response starts from the gateway's template (`wire.protocol.ResponsesPresent`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from derender.custom_input import CustomInputStream, custom_input
from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    DeltaToolCall,
    TopLogprob,
    Usage,
)
from wire.protocol import Callee, ResponsesPresent
from wire.responses import (
    CustomToolCallItem,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemEvent,
    ItemStatus,
    LifecycleEvent,
    LogprobOut,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    PartEvent,
    ReasoningItem,
    ReasoningText,
    ResponseUsage,
    TopLogprobOut,
)

_encode = msgspec.json.Encoder().encode

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""The chat finish reasons that leave a response incomplete, with OpenAI's reason for each."""


def _callee_of(callees: Mapping[str, Callee], flat: str) -> Callee:
    """The tool a model's flat function name calls (a plain function when the request named none)."""
    return callees.get(flat) or Callee(flat)


class ResponsesAssembler:
    """One answer's Responses events as SSE frames (`feed` each chat chunk, then `end`), or
    its whole Response (`whole`). `response` is the finished Response once either is done."""

    def __init__(self, present: ResponsesPresent) -> None:
        self._template = present.response
        self._callees = present.callees
        # Not `self.callee`: the output is this assembler's, and an output holding its assembler
        # is a reference cycle, left to the cyclic collector with the whole answer.
        self._output = _StreamedOutput(partial(_callee_of, present.callees), present.text_call)
        self._text_call = present.text_call
        self._opened = False
        self._finish = "stop"
        self._usage: Usage | None = None
        self.sequence = 0
        """The next event's `sequence_number` (an error event after the last takes it)."""
        self.response: dict[str, Any] | None = None

    def callee(self, flat: str) -> Callee:
        return _callee_of(self._callees, flat)

    def feed(self, chunk: ChatCompletionChunk) -> bytes:  # hot: once per chunk
        events = self._opening()
        if chunk.usage:
            self._usage = chunk.usage
        for choice in chunk.choices:
            events += self._output.feed(choice.delta, choice.logprobs)
            self._finish = choice.finish_reason or self._finish
        return self._frames(events) if events else b""

    def end(self) -> bytes:
        """The events that close the open item and the response."""
        events = self._opening()
        events += self._output.close("incomplete" if self._finish in INCOMPLETE else "completed")
        response = self.response = self._response(self._output.items, _usage(self._usage), self._finish)
        events.append(LifecycleEvent(type=f"response.{response['status']}", response=response))
        return self._frames(events)

    def error(self, code: str | None, message: str, param: str | None) -> bytes:
        """The event that ends a stream that failed after its first event."""
        return self._frames([ErrorEvent(type="error", code=code, message=message, param=param)])

    def whole(self, completion: ChatCompletion) -> dict[str, Any]:
        choice = completion.choices[0]
        finish = choice.finish_reason or "stop"
        output = _output(choice.message, choice.logprobs, self.callee, self._text_call)
        if output and finish in INCOMPLETE:
            output[-1].status = "incomplete"  # the item the limit cut, as a stream closes it
        self.response = self._response(output, _usage(completion.usage), finish)
        return self.response

    def _opening(self) -> list[Event]:
        if self._opened:
            return []
        self._opened = True
        started = dict(self._template)
        return [
            LifecycleEvent(type="response.created", response=started),
            LifecycleEvent(type="response.in_progress", response=started),
        ]

    def _response(self, output: list[OutputItem], usage: ResponseUsage | None, finish: str) -> dict[str, Any]:
        reason = INCOMPLETE.get(finish)
        status: ItemStatus = "incomplete" if reason else "completed"
        return {
            **self._template,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": IncompleteDetails(reason) if reason else None,
            "output": output,
            "usage": usage,
        }

    def _frames(self, events: Iterable[Event]) -> bytes:
        """Events as SSE frames, numbered in the order they are written."""
        out = []
        for event in events:
            event.sequence_number = self.sequence
            self.sequence += 1
            out.append(b"event: " + event.type.encode() + b"\ndata: " + _encode(event) + b"\n\n")
        return b"".join(out)


def _output(
    message: ChatCompletionMessage,
    logprobs: ChatLogprobs | None,
    callee: Callable[[str], Callee],
    text_call: Callee | None,
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
        items.append(_call_item(callee, call.id, call.function.name, call.function.arguments, "completed"))
    return items


def _call_item(
    find: Callable[[str], Callee], call_id: str, flat: str, arguments: str, status: ItemStatus
) -> OutputItem:
    """The model's call of a (flattened) chat function as the Responses item of its tool."""
    callee = find(flat)
    namespace = callee.namespace if callee.namespace is not None else UNSET
    if callee.custom:
        return CustomToolCallItem(
            id=_item_id("ctc"), call_id=call_id, name=callee.name, input=custom_input(arguments), namespace=namespace
        )
    return FunctionCallItem(
        id=_item_id("fc"), call_id=call_id, name=callee.name, arguments=arguments, status=status, namespace=namespace
    )


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
    def opened(self) -> list[Event]:
        item = ReasoningItem(id=self.id, status="in_progress")
        return [self._item_event("added", item), self._part_event("added", ReasoningText(""))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> Event:
        return self._delta_event("reasoning_text", text, content_index=0)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[Event]]:
        """The finished item, and the events that close it (`output_item.done` last)."""
        part = ReasoningText("".join(self.pieces))
        item = ReasoningItem(id=self.id, content=[part], status=status)
        done = self._done_event("reasoning_text", content_index=0, text=part.text)
        return item, [done, self._part_event("done", part), self._item_event("done", item)]


class _StreamedMessage(_Streamed):
    def __init__(self, prefix: str, index: int, key: object) -> None:
        super().__init__(prefix, index, key)
        self.tokens: list[ChatLogprobToken] = []

    def opened(self) -> list[Event]:
        item = MessageItem(id=self.id, status="in_progress")
        return [self._item_event("added", item), self._part_event("added", OutputText(text=""))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> Event:
        self.tokens += tokens
        return self._delta_event("output_text", text, content_index=0, logprobs=_logprobs(tokens, with_bytes=False))

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[Event]]:
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

    def opened(self) -> list[Event]:
        return [self._item_event("added", self._item("", "in_progress"))]

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> Event | None:
        """The event for `text`; None where a subclass has nothing to show yet."""
        return self._delta_event("function_call_arguments", text)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[Event]]:
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

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> Event | None:
        self.pieces.append(text)
        shown = self.text.feed(text)
        return self._input_delta(shown) if shown else None

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[Event]]:
        item = self._custom(custom_input("".join(self.pieces)), status)
        shown = "".join(self.shown)
        rest = item.input[len(shown):] if item.input.startswith(shown) else ""  # arguments not streamed: all of it
        events: list[Event] = [self._input_delta(rest)] if rest else []
        done = DoneEvent(
            type="response.custom_tool_call_input.done", item_id=self.id, output_index=self.index, input=item.input
        )
        return item, [*events, done, self._item_event("done", item)]

    def opened(self) -> list[Event]:
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

    def delta(self, text: str, tokens: list[ChatLogprobToken]) -> Event:
        self.pieces.append(text)
        return self._input_delta(text)

    def closed(self, status: ItemStatus) -> tuple[OutputItem, list[Event]]:
        item = self._custom("".join(self.pieces), status)
        done = DoneEvent(
            type="response.custom_tool_call_input.done", item_id=self.id, output_index=self.index, input=item.input
        )
        return item, [done, self._item_event("done", item)]


Streamed = _StreamedReasoning | _StreamedMessage | _StreamedCall


class _StreamedOutput:
    """The output items of one streamed answer. One is open at a time: a delta of another
    kind (or of another tool call) closes it and opens the next."""

    def __init__(self, callee: Callable[[str], Callee], text_call: Callee | None) -> None:
        self.items: list[OutputItem] = []
        self.open: Streamed | None = None
        self.callee, self.text_call = callee, text_call

    def feed(self, delta: ChatDelta, logprobs: ChatLogprobs | None) -> list[Event]:  # hot: once per chunk
        events: list[Event] = []
        if reasoning := _present(delta.reasoning) or _present(delta.reasoning_content):
            events += self._to("reasoning", lambda index: _StreamedReasoning("rs", index, "reasoning"))
            events += self._delta(reasoning, [])
        if content := _present(delta.content):
            events += self._message(content, _tokens(logprobs))
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def close(self, status: ItemStatus) -> list[Event]:
        if self.open is None:
            return []
        item, events = self.open.closed(status)
        self.items.append(item)
        self.open = None
        return events

    def _to(self, key: object, make: Callable[[int], Streamed]) -> list[Event]:
        if self.open is not None and self.open.key == key:
            return []
        events = self.close("completed")
        self.open = make(len(self.items))
        return events + self.open.opened()

    def _message(self, content: str, tokens: list[ChatLogprobToken]) -> list[Event]:
        callee = self.text_call
        if callee is None:
            events = self._to("message", lambda index: _StreamedMessage("msg", index, "message"))
        else:
            events = self._to(
                "text call", lambda index: _StreamedTextCall("ctc", index, "text call", _item_id("call"), callee)
            )
        return events + self._delta(content, tokens)

    def _delta(self, text: str, tokens: list[ChatLogprobToken]) -> list[Event]:
        assert self.open is not None
        event = self.open.delta(text, tokens)
        return [event] if event is not None else []

    def _call(self, call: DeltaToolCall) -> list[Event]:
        function = call.function or None
        call_id = call.id if isinstance(call.id, str) else _item_id("call")  # a call's first delta has both
        callee = self.callee((_present(function.name) if function else None) or "")
        key = ("call", call.index)
        make, prefix = (_StreamedCustomCall, "ctc") if callee.custom else (_StreamedCall, "fc")
        events = self._to(key, lambda index: make(prefix, index, key, call_id, callee))
        arguments = _present(function.arguments) if function else None
        if arguments is not None:
            events += self._delta(arguments, [])
        return events


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
