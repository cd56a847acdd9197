"""Every tool-call family on the offline test tokenizers, for cross-family properties.

One `Family` per tool parser: its reasoning parser (the one models of the family
pair it with), a vocabulary with the family's marker tokens, and a way to write
output ids where every character outside a marker is its own token or tokens, so
a cut (`max_tokens`) can fall after any character of a call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from derender.chat import ChatOptions
from derender.parsers import TOOL_PARSERS
from derender.parsers.base import ToolCallText
from derender.parsers.choice import bind_parsers
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from engine.qwen3.fixtures import cache_dir
from tests.support import deepseek, glm_tokenizer, harmony_tokenizer, kimi_k2, llama3, minimax_m2, mistral
from tests.support.family_tokenizers import build_family_tokenizer

# tool parser -> (reasoning parser or None, the family's marker tokens added to the Qwen3 tokenizer).
FAMILIES: dict[str, tuple[str | None, tuple[tuple[str, bool], ...]]] = {
    "hermes": ("qwen3", ()),
    "qwen3_coder": ("qwen3", ()),
    "glm45": ("glm45", glm_tokenizer.ADDED),
    "glm47": ("glm45", glm_tokenizer.ADDED),
    "kimi_k2": ("kimi_k2", tuple((text, True) for text in kimi_k2.SPECIALS)),
    "openai": ("openai_gptoss", tuple((text, True) for text in harmony_tokenizer.MARKERS)),
    "deepseek_v3": ("deepseek_v3", deepseek.ADDED),
    "deepseek_v31": ("deepseek_v3", deepseek.ADDED),
    "minimax_m2": ("minimax_m2", minimax_m2.ADDED),
    "mistral": ("mistral", tuple((text, True) for text in mistral.SPECIALS)),
    "llama3_json": (None, tuple((text, True) for text in llama3.SPECIALS)),
    "pythonic": (None, ()),
}

UNTYPED_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "f", "description": "Anything.", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class Family:
    tool_parser: str
    reasoning_parser: str | None
    tokenizer: Any
    vocab: TokenVocab
    markers: dict[str, int]
    """Every marker's text -> id (reasoning and tool families)."""

    def options(
        self, tools: Sequence[dict[str, Any]] = (UNTYPED_TOOL,), *, reasoning: bool = True, **request: Any
    ) -> ChatOptions:
        """A chat request's options; `reasoning=False` leaves the reasoning parser out (output
        is content from the first token, whatever the family's template pre-opens)."""
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **request}
        if tools:
            body["tools"] = list(tools)
        parsed = msgspec.convert(body, ChatCompletionRequest)
        return ChatOptions.from_request(
            parsed, reasoning_parser=self.reasoning_parser if reasoning else None, tool_parser=self.tool_parser
        )

    def format_calls(self, calls: Sequence[ToolCallText]) -> str:
        write = TOOL_PARSERS[self.tool_parser].format_calls
        assert write is not None
        return write(calls)

    def char_ids(self, text: str) -> list[int]:
        """`text` as output ids: each marker its token, every other character encoded on its own."""
        ids: list[int] = []
        pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.markers, key=len, reverse=True)) + ")")
        for part in pattern.split(text):
            if not part:
                continue
            marker = self.markers.get(part)
            if marker is not None:
                ids.append(marker)
                continue
            for char in part:
                ids += self.tokenizer.encode(char, add_special_tokens=False)
        return ids

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def family(tool_parser: str, qwen3_tokenizer_dir: Path) -> Family:
    """The family's test tokenizer and vocabulary."""
    from transformers import AutoTokenizer

    reasoning, added = FAMILIES[tool_parser]
    folder = build_family_tokenizer(cache_dir(), f"e2e-{tool_parser}", list(added)) if added else qwen3_tokenizer_dir
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    parsers = bind_parsers(vocab, reasoning, tool_parser)
    assert parsers is not None
    return Family(tool_parser, reasoning, tokenizer, vocab, dict(parsers.marker_ids))
