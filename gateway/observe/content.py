"""The completion a client was sent, as OpenTelemetry GenAI's `gen_ai.output.messages`.

Only under `tracing.record_content` (completions are user data): the request's answer is
kept as the bytes that went to the client (`Tally.content`), whole or streamed, and read
back here once, when its span is described. Each choice becomes one assistant message of
`parts` (reasoning, text, tool calls), as the conventions' JSON schema has them; its finish
reason is the outcome's, not re-read from the bytes.

    chat         choices[].message, or the chunks' choices[].delta, by index
    completions  choices[].text
    responses    the response object (streamed: the one the last event carries)
    messages     the message's content blocks, or the stream's block deltas
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

_FINISH = {"tool_calls": "tool_call", None: "stop"}
"""Chat's finish reasons in the conventions' words, where they differ."""


@dataclass
class _Call:
    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class _Choice:
    """One choice's output, as it accumulates."""

    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)

    def call(self, index: int) -> _Call:
        return self.calls.setdefault(index, _Call())

    def parts(self) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if self.reasoning:
            parts.append({"type": "reasoning", "content": "".join(self.reasoning)})
        if self.text:
            parts.append({"type": "text", "content": "".join(self.text)})
        for call in self.calls.values():
            arguments = _arguments(call.arguments)
            parts.append({"type": "tool_call", "id": call.id, "name": call.name, "arguments": arguments})
        return parts


def output_messages(endpoint: str, sent: bytes, finish_reasons: Sequence[str | None]) -> str:
    """`gen_ai.output.messages` of an answer (`sent`: its body, or its SSE stream) to `endpoint`."""
    choices: dict[int, _Choice] = {}
    for payload in _payloads(sent):
        _READERS[endpoint](payload, choices)
    messages = [
        {
            "role": "assistant",
            "parts": choice.parts(),
            "finish_reason": _finish(finish_reasons, index),
        }
        for index, choice in sorted(choices.items())
    ]
    return msgspec.json.encode(messages).decode()


def _finish(reasons: Sequence[str | None], index: int) -> str:
    reason = reasons[index] if index < len(reasons) else None
    return _FINISH.get(reason, reason) or "stop"


def _arguments(raw: str) -> Any:
    """A tool call's arguments as JSON when they are (the schema's object), else as sent."""
    try:
        return msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        return raw


def _payloads(sent: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of an answer: its body, or each `data:` line of its stream."""
    if not sent.startswith((b"data:", b"event:", b":")):
        yield from _objects([sent])
        return
    lines = (line[5:].strip() for line in sent.split(b"\n") if line.startswith(b"data:"))
    yield from _objects(line for line in lines if line.startswith(b"{"))


def _objects(raws: Iterator[bytes] | list[bytes]) -> Iterator[dict[str, Any]]:
    for raw in raws:
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue  # not ours to judge here: the client got it as it was
        if isinstance(value, dict):
            yield value


def _chat(payload: dict[str, Any], choices: dict[int, _Choice]) -> None:
    for item in payload.get("choices") or ():
        choice = choices.setdefault(item.get("index", 0), _Choice())
        said = item.get("message") or item.get("delta") or {}
        _said(choice, said.get("reasoning_content") or said.get("reasoning"), said.get("content"))
        for position, call in enumerate(said.get("tool_calls") or ()):
            _chat_call(choice.call(call.get("index", position)), call)


def _chat_call(call: _Call, sent: dict[str, Any]) -> None:
    call.id = sent.get("id") or call.id
    function = sent.get("function") or {}
    call.name += function.get("name") or ""
    call.arguments += function.get("arguments") or ""


def _said(choice: _Choice, reasoning: Any, text: Any) -> None:
    if isinstance(reasoning, str) and reasoning:
        choice.reasoning.append(reasoning)
    if isinstance(text, str) and text:
        choice.text.append(text)


def _completions(payload: dict[str, Any], choices: dict[int, _Choice]) -> None:
    for item in payload.get("choices") or ():
        _said(choices.setdefault(item.get("index", 0), _Choice()), None, item.get("text"))


def _responses(payload: dict[str, Any], choices: dict[int, _Choice]) -> None:
    response = payload.get("response") if "response" in payload else payload
    if not isinstance(response, dict) or "output" not in response:
        return  # a stream's deltas: its last event carries the whole response
    choice = choices[0] = _Choice()  # the last one seen is the whole answer
    for item in response.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            _said(choice, None, "".join(part.get("text") or "" for part in item.get("content") or ()))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or ()
            _said(choice, "".join(part.get("text") or "" for part in parts), None)
        elif kind == "function_call":
            call = choice.call(len(choice.calls))
            call.id, call.name = item.get("call_id"), item.get("name") or ""
            call.arguments = item.get("arguments") or ""


def _messages(payload: dict[str, Any], choices: dict[int, _Choice]) -> None:
    choice = choices.setdefault(0, _Choice())
    kind = payload.get("type")
    if kind == "message":  # a whole answer
        for position, block in enumerate(payload.get("content") or ()):
            _block(choice, position, block)
            _block_delta(choice, position, block)
    elif kind == "content_block_start":
        _block(choice, payload.get("index", 0), payload.get("content_block") or {})
    elif kind == "content_block_delta":
        _block_delta(choice, payload.get("index", 0), payload.get("delta") or {})


def _block(choice: _Choice, position: int, block: dict[str, Any]) -> None:
    if block.get("type") == "tool_use":
        call = choice.call(position)
        call.id, call.name = block.get("id"), block.get("name") or ""
        if block.get("input"):
            call.arguments = msgspec.json.encode(block["input"]).decode()


def _block_delta(choice: _Choice, position: int, delta: dict[str, Any]) -> None:
    _said(choice, delta.get("thinking"), delta.get("text"))
    if delta.get("type") == "input_json_delta":
        choice.call(position).arguments += delta.get("partial_json") or ""


_READERS = {"chat": _chat, "completions": _completions, "responses": _responses, "messages": _messages}
