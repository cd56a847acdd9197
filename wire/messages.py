"""Anthropic's Messages API, its answer side: the content blocks, usage and stream events a
Message is made of, and Anthropic's error body (names follow the `anthropic` SDK's types).

The engine writes them on the `derender` route (`derender.messages`), the gateway on the
others; the request side (messages, tools, context edits) is the gateway's
(`gateway.apis.messages`), whose blocks reuse these.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType


class Typed(Struct, tag_field="type"):
    """A block or event whose `type` names its kind (written first)."""


class TextBlock(Typed, tag="text"):
    text: str


class ThinkingBlock(Typed, tag="thinking"):
    thinking: str
    signature: str = ""  # ours are empty: nothing here checks one


class ToolUseBlock(Typed, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock
"""What an answer holds."""


class MessagesUsage(Struct):
    """Anthropic counts cached prompt tokens apart: the three inputs add up to the prompt."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class Message(Typed, tag="message", kw_only=True):
    id: str
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage
    context_management: dict[str, Any] | UnsetType = UNSET  # only when the request sent some


class TextDelta(Typed, tag="text_delta"):
    text: str


class ThinkingDelta(Typed, tag="thinking_delta"):
    thinking: str


class SignatureDelta(Typed, tag="signature_delta"):
    signature: str


class InputJSONDelta(Typed, tag="input_json_delta"):
    partial_json: str


class MessageStart(Typed, tag="message_start"):
    message: Message


class ContentBlockStart(Typed, tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(Typed, tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


class ContentBlockStop(Typed, tag="content_block_stop"):
    index: int


class StopInfo(Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(Typed, tag="message_delta"):
    delta: StopInfo
    usage: MessagesUsage
    context_management: dict[str, Any] | UnsetType = UNSET


class MessageStop(Typed, tag="message_stop"):
    pass


class ErrorObject(Struct):
    type: str
    message: str


class ErrorResponse(Typed, tag="error"):
    """Anthropic's error body, and the data of its `error` event."""

    error: ErrorObject


Event = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorResponse
)

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}
"""Anthropic's documented types by status; the SDK's ErrorType has `timeout_error` for a 504."""


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
