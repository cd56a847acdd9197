"""What the engine knows beyond a request, for the writers that turn its outputs into bytes."""

from __future__ import annotations

from dataclasses import dataclass

from derender.chat import ReasoningField
from derender.vocab import TokenVocab


@dataclass(frozen=True, slots=True)
class WriterContext:
    """What the engine knows beyond the request: its model, tokenizer and parsers."""

    model: str
    vocab: TokenVocab | None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    reasoning_field: ReasoningField = "reasoning"
