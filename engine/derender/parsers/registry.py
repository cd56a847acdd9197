"""Parser families by vLLM's names (`--reasoning-parser`, `--tool-call-parser`).

Each entry is a factory, not a string: adding a family is one module and one
line here. Aliases are the same factory under a second name, as in vLLM.
"""

from __future__ import annotations

import functools

from engine.derender.parsers.base import ReasoningFactory, ToolFactory, UnknownParser
from engine.derender.parsers import hermes
from engine.derender.parsers.think import BoundThink, ThinkSyntax, format_think
from engine.derender.vocab import TokenVocab

QWEN3_THINK = ThinkSyntax(start="<think>", end="</think>", turn_start="<|im_start|>")


def _qwen3(vocab: TokenVocab) -> BoundThink:
    return BoundThink(vocab, QWEN3_THINK)


REASONING_PARSERS: dict[str, ReasoningFactory] = {
    "qwen3": ReasoningFactory("qwen3", _qwen3, functools.partial(format_think, QWEN3_THINK)),
}
TOOL_PARSERS: dict[str, ToolFactory] = {
    "hermes": ToolFactory("hermes", hermes.BoundHermes, hermes.format_calls, hermes.forced_prefix),
}


def reasoning_factory(name: str) -> ReasoningFactory:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise UnknownParser(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


def tool_factory(name: str) -> ToolFactory:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownParser(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
