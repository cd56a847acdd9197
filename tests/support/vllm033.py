"""vLLM 0.33's derender wire, mirrored field by field for tests, strictly.

Written from vLLM 0.33.0's `entrypoints/scale_out/token_in_token_out/protocol.py`
(`ParseContext`, `GenerateDerenderChoice`, `GenerateDerenderResponse`) and the
pydantic models they nest (`ChatMessage`, `ToolCall`, `FunctionCall`,
`ChatCompletionLogProbs`, `UsageInfo`, `WeightVersionSpan`, `Logprob`). Every
struct refuses unknown fields, so an answer that decodes here uses only names
vLLM 0.33 declares; `*_KEYS` are the keys vLLM's `model_dump()` writes (every
field, nulls included; `tool_calls` only when there are calls).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct


class FunctionDefinition(Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatCompletionToolsParam(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


class ChatCompletionNamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class ChatCompletionNamedToolChoiceParam(Struct, forbid_unknown_fields=True, kw_only=True):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class ParseContext(Struct, forbid_unknown_fields=True, kw_only=True):
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    history_tool_call_cnt: int = 0


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: str | None = None
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: FunctionCall | None = None
    tool_calls: list[ToolCall] = []
    reasoning: str | None = None


class ChatCompletionLogProb(Struct, forbid_unknown_fields=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(Struct, forbid_unknown_fields=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(Struct, forbid_unknown_fields=True):
    content: list[ChatCompletionLogProbsContent] | None = None


class WeightVersionSpan(Struct, forbid_unknown_fields=True):
    version: str
    start: int
    end: int


class PromptTokenUsageInfo(Struct, forbid_unknown_fields=True):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class CompletionTokenUsageInfo(Struct, forbid_unknown_fields=True):
    reasoning_tokens: int = 0


class UsageInfo(Struct, forbid_unknown_fields=True):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    completion_tokens_details: CompletionTokenUsageInfo | None = None


class Logprob(Struct, forbid_unknown_fields=True):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PlaceholderRangeInfo(Struct, forbid_unknown_fields=True):
    offset: int
    length: int


class GenerateDerenderChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None


class GenerateDerenderResponse(Struct, forbid_unknown_fields=True, kw_only=True):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, list[PlaceholderRangeInfo]] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["derender"] = "derender"
    choices: list[GenerateDerenderChoice]


RESPONSE_KEYS = frozenset(GenerateDerenderResponse.__struct_fields__)
CHOICE_KEYS = frozenset(GenerateDerenderChoice.__struct_fields__)
MESSAGE_KEYS = frozenset(ChatMessage.__struct_fields__) - {"tool_calls"}
"""Without `tool_calls`: vLLM's serializer drops the key when there are no calls."""

RESPONSE = msgspec.json.Decoder(GenerateDerenderResponse)
PARSE_CONTEXT = msgspec.json.Decoder(ParseContext)


def check_keys(body: dict[str, Any]) -> None:
    """`body` (decoded JSON) has exactly the keys vLLM 0.33's `model_dump()` writes."""
    assert set(body) == RESPONSE_KEYS, set(body) ^ RESPONSE_KEYS
    for choice in body["choices"]:
        assert set(choice) == CHOICE_KEYS, set(choice) ^ CHOICE_KEYS
        message = set(choice["message"])
        expected = MESSAGE_KEYS | ({"tool_calls"} if "tool_calls" in message else set())
        assert message == expected, message ^ expected
        assert choice["message"].get("tool_calls", [1]), "an empty tool_calls list is left out, as vLLM does"
