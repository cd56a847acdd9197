"""OpenAI `usage` of a request's choices, shared by chat and completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from wire.openai_schema import CompletionTokensDetails, PromptTokensDetails, Usage
from wire.protocol import EngineSummary


class _Counted(Protocol):
    @property
    def completion_tokens(self) -> int: ...


class _Choice(Protocol):
    @property
    def finished(self) -> bool: ...

    @property
    def finish_reason(self) -> str | None: ...


class _Derender(Protocol):
    @property
    def choices(self) -> Sequence[_Choice]: ...

    def usage(self) -> Usage: ...


def open_choices(derender: _Derender) -> list[int]:
    """Indices of a derender's choices that have not finished."""
    return [i for i, choice in enumerate(derender.choices) if not choice.finished]


def derender_summary(derender: _Derender) -> EngineSummary:
    """Finish reasons and token counts of a derender's choices so far (the engine's summary)."""
    return summary_of([choice.finish_reason for choice in derender.choices], derender.usage())


def summary_of(finish_reasons: list[str | None], usage: Usage) -> EngineSummary:
    prompt_details, completion_details = usage.prompt_tokens_details, usage.completion_tokens_details
    return EngineSummary(
        finish_reasons=finish_reasons,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens or 0,
        cached_tokens=(prompt_details.cached_tokens or 0) if prompt_details is not None else 0,
        reasoning_tokens=completion_details.reasoning_tokens if completion_details is not None else 0,
    )


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
