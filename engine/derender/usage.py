"""OpenAI `usage` of a request's choices, shared by chat and completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.openai_schema import CompletionTokensDetails, PromptTokensDetails, Usage


class _Counted(Protocol):
    @property
    def completion_tokens(self) -> int: ...


def usage_of(
    prompt_tokens: int,
    choices: Sequence[_Counted],
    *,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> Usage:
    """`reasoning_tokens` None leaves the details out (no reasoning parser), as vLLM does."""
    completion = sum(choice.completion_tokens for choice in choices)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
    if cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached_tokens)
    if reasoning_tokens is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return usage
