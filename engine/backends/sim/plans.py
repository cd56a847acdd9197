"""What the simulator writes: each mode's plan, the ids a choice holds before the token rules.

Echo and script plans are shared by every choice of a request; auto and agent plans are
drawn per choice from its own random stream. Text is written in the configured reasoning
and tool-call families (`reasoning_format`, `tool_format`), then encoded once.
"""

from __future__ import annotations

import random
from typing import Any

from tokenizers import Tokenizer

from engine.backends.sim.config import SimBackendConfig
from engine.backends.sim.prompt import TOOL_CALL_START, Prompt, PromptReader, tool_results
from engine.backends.sim.schema import constrained_text, fake_arguments
from engine.backends.sim.tokenizer import encoder
from engine.backends.sim.words import Words
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from derender.parsers.base import ToolCallText
from wire.protocol import StructuredOutputs

_CONTENT_WORDS = (16, 64)
_REASONING_WORDS = (8, 32)
_SLOT = "\x00"  # stands for the reasoning text when a family's reasoning block is split in two
AGENT_ANSWER = "The command printed: "
"""How agent mode's answer to tool results starts (the results' text follows)."""


class Planner:
    """Plans choices for one configuration; holds the encoded pieces it writes with."""

    def __init__(self, config: SimBackendConfig, tokenizer: Tokenizer) -> None:
        self._config = config
        self._encode = encoder(tokenizer)
        self.reader = PromptReader(tokenizer)
        self.words = Words(tokenizer)
        self._think_open: list[int] | None = None
        if config.reasoning_format is not None:
            write_reasoning = REASONING_PARSERS[config.reasoning_format].format_reasoning
            assert write_reasoning is not None  # checked by the config
            think_open, _, think_close = write_reasoning(_SLOT).partition(_SLOT)
            self._think_open = self._encode(think_open)
            self._think_close = self._encode(think_close)
            self._empty_reasoning = self._encode(write_reasoning(""))
        write_calls = TOOL_PARSERS[config.tool_format].format_calls
        assert write_calls is not None
        self._write_calls = write_calls
        self._write_content = TOOL_PARSERS[config.tool_format].format_content or str
        self._script = [self._encode(text) for text in config.script]
        self._script_turn = 0

    def shared(self, prompt: Prompt) -> list[int] | None:
        """The plan every choice shares in echo and script mode; None in auto and agent mode."""
        if self._config.mode == "echo":
            return self._encode(self.reader.last_user_text(prompt.ids))
        if self._config.mode == "script":
            plan = self._script[self._script_turn % len(self._script)]
            self._script_turn += 1
            return plan
        return None

    def drawn(self, prompt: Prompt, rng: random.Random, constraint: StructuredOutputs | None) -> list[int]:
        """One choice's plan in auto or agent mode, from its own random stream."""
        if self._config.mode == "agent":
            return self._agent_plan(prompt, rng)
        return self._auto_plan(prompt, rng, constraint)

    def _auto_plan(self, prompt: Prompt, rng: random.Random, constraint: StructuredOutputs | None) -> list[int]:
        if prompt.open_call is not None and prompt.tools:
            return self._finish_call(prompt.open_call, prompt.tools, rng)
        plan: list[int] = []
        if prompt.thinking_open and self._think_open is not None:
            plan += self._reasoning(rng)  # a constraint holds after reasoning ends, as in vLLM
        if constraint is not None:
            # Constrained output starts right where reasoning ends: no whitespace a grammar would refuse.
            while plan and self.reader.decode(plan[-1:]).isspace():
                plan.pop()
            plan += self._encode(constrained_text(constraint, rng))
        elif prompt.tools:
            plan += self._tool_call(prompt.tools, rng)
        else:
            plan += self._content(rng)
        return plan

    def _agent_plan(self, prompt: Prompt, rng: random.Random) -> list[int]:
        plan = self._reasoning(rng) if prompt.thinking_open and self._think_open is not None else []
        results = tool_results(self.reader.last_user_text(prompt.ids))
        if results:
            return plan + self._encode(self._write_content(AGENT_ANSWER + "\n".join(results)))
        offered = {tool["name"] for tool in prompt.tools}
        name = next((name for name in self._config.agent_calls if name in offered), None)
        if name is None:
            return plan + self._encode(self._write_content(self.reader.decode(self._content(rng))))
        return plan + self._encode(self._write_calls([ToolCallText(name, self._config.agent_calls[name])]))

    def _reasoning(self, rng: random.Random) -> list[int]:
        assert self._think_open is not None
        if not self._config.reasoning:
            return self._empty_reasoning
        words = self.words.sentences(rng, rng.randint(*_REASONING_WORDS), start=True)
        return self._think_open + [i for piece in words for i in piece] + self._think_close

    def _tool_call(self, tools: tuple[dict[str, Any], ...], rng: random.Random) -> list[int]:
        tool = tools[rng.randrange(len(tools))]
        return self._encode(self._write_calls([self._fake_call(tool, rng)]))

    def _finish_call(self, opened: str, tools: tuple[dict[str, Any], ...], rng: random.Random) -> list[int]:
        """Continue a call the prompt opened: the named tool if only it fits the opening, else one of them."""
        opening = TOOL_CALL_START + opened
        calls = [self._write_calls([self._fake_call(tool, rng)]) for tool in tools]
        fitting = [text for text in calls if text.startswith(opening)]
        if len(fitting) != 1:
            fitting = [calls[rng.randrange(len(calls))]]
        return self._encode(fitting[0].removeprefix(opening))

    @staticmethod
    def _fake_call(tool: dict[str, Any], rng: random.Random) -> ToolCallText:
        return ToolCallText(tool["name"], fake_arguments(tool.get("parameters"), rng))

    def _content(self, rng: random.Random) -> list[int]:
        if self._config.output_tokens is not None:
            return self.words.exactly(rng, self._config.output_tokens)
        words = self.words.sentences(rng, rng.randint(*_CONTENT_WORDS), start=True)
        return [i for piece in words for i in piece]
