"""Parser families by vLLM's names (`--reasoning-parser`, `--tool-call-parser`).

Each entry is a factory, not a string: adding a family is one module and one
line here. Aliases are the same factory under a second name, as in vLLM.
"""

from __future__ import annotations

import functools

from derender.parsers.base import ReasoningFactory, ToolFactory, UnknownParser
from derender.parsers import deepseek
from derender.parsers import glm
from derender.parsers import harmony
from derender.parsers import hermes
from derender.parsers import kimi_k2
from derender.parsers import llama3_json
from derender.parsers import minimax_m2
from derender.parsers import mistral
from derender.parsers import pythonic
from derender.parsers import qwen3_coder
from derender.parsers.think import BoundThink, ThinkSyntax, format_think
from derender.vocab import TokenVocab

QWEN3_THINK = ThinkSyntax(start="<think>", end="</think>", turn_start="<|im_start|>")


def _qwen3(vocab: TokenVocab) -> BoundThink:
    return BoundThink(vocab, QWEN3_THINK)


REASONING_PARSERS: dict[str, ReasoningFactory] = {
    "qwen3": ReasoningFactory("qwen3", _qwen3, functools.partial(format_think, QWEN3_THINK)),
    "glm45": glm.REASONING_45,
    "glm47": glm.REASONING_47,
    "kimi_k2": ReasoningFactory("kimi_k2", kimi_k2.BoundKimiReasoning, kimi_k2.format_reasoning),
    "openai_gptoss": harmony.REASONING,
    "mistral": mistral.REASONING,
    "deepseek_r1": deepseek.REASONING_R1,
    "deepseek_v3": deepseek.REASONING_V3,
    "minimax_m2": minimax_m2.REASONING,
    "minimax_m2_append_think": minimax_m2.APPEND_THINK,
}
TOOL_PARSERS: dict[str, ToolFactory] = {
    "hermes": ToolFactory("hermes", hermes.BoundHermes, hermes.format_calls, hermes.forced_prefix),
    "glm45": glm.TOOLS_45,
    "glm47": glm.TOOLS_47,
    "qwen3_coder": qwen3_coder.FACTORY,
    "qwen3_xml": qwen3_coder.FACTORY,
    "kimi_k2": ToolFactory("kimi_k2", kimi_k2.BoundKimiTools, kimi_k2.format_calls, kimi_k2.forced_prefix),
    "openai": harmony.TOOLS,
    "mistral": mistral.TOOLS,
    "deepseek_v3": deepseek.TOOLS_V3,
    "deepseek_v31": deepseek.TOOLS_V31,
    "llama3_json": llama3_json.FACTORY,
    "llama4_json": llama3_json.FACTORY,
    "minimax_m2": minimax_m2.TOOLS,
    "pythonic": pythonic.PYTHONIC,
    "llama4_pythonic": pythonic.LLAMA4_PYTHONIC,
}


def reasoning_factory(name: str) -> ReasoningFactory:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise UnknownParser(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def tool_factory(name: str) -> ToolFactory:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownParser(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
