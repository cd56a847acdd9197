"""Checked conversions from loosely typed library results to the types tests work with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageToolCallUnion,
)


def token_ids(value: object) -> list[int]:
    """`value` as a list of token ids: a tokenizer's list (or tuple) of ints, failing on anything else
    (text, a batch of lists)."""
    assert isinstance(value, list | tuple), type(value)
    ids = [token for token in value if isinstance(token, int)]
    assert len(ids) == len(value), value
    return ids


def function_calls(calls: Sequence[ChatCompletionMessageToolCallUnion] | None) -> list[ChatCompletionMessageFunctionToolCall]:
    """A message's `tool_calls` (None: no calls), each of them a function call: the gateway answers no other kind."""
    found = list(calls or [])
    functions = [call for call in found if isinstance(call, ChatCompletionMessageFunctionToolCall)]
    assert len(functions) == len(found), found
    return functions


def openai_tools(tools: list[dict[str, Any]]) -> list[ChatCompletionFunctionToolParam]:
    """Plain function-tool definitions as the OpenAI SDK's parameter type, checked field by field."""
    return msgspec.convert(tools, list[ChatCompletionFunctionToolParam])
