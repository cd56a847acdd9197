"""OpenAI's Responses API, its answer side: the output items, usage and stream events a
Response is made of (names follow the `openai` SDK's types).

The engine writes them on the `derender` route (`derender.responses`), the gateway on the
others; the request side (input items, tools, settings) is the gateway's
(`gateway.apis.responses`).
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType

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


# ------------------------------------------------------------ stream events


class Event(Struct, kw_only=True):
    type: str
    sequence_number: int = -1  # numbered as it is written


class LifecycleEvent(Event, kw_only=True):
    response: dict[str, Any]
    """The Response so far: the gateway's template (the request's settings echoed) with
    what the answer filled in (`derender.responses`)."""


class ItemEvent(Event, kw_only=True):
    output_index: int
    item: OutputItem


class PartEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class DeltaEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int | UnsetType = UNSET
    delta: str
    logprobs: list[LogprobOut] | UnsetType = UNSET


class DoneEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int | UnsetType = UNSET
    text: str | UnsetType = UNSET
    logprobs: list[LogprobOut] | UnsetType = UNSET
    name: str | UnsetType = UNSET  # function_call_arguments.done: OpenAI's events carry the name
    arguments: str | UnsetType = UNSET
    input: str | UnsetType = UNSET  # custom_tool_call_input.done


class ErrorEvent(Event, kw_only=True):
    code: str | None
    message: str
    param: str | None



FINAL_TYPES = ("response.completed", "response.incomplete")
"""The events that end a stream; each carries the finished Response."""
