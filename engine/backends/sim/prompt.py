"""Reading a prompt: the ChatML structure the simulator answers to, from the prompt's ids.

Only the few tokens needed are decoded: the tail (is thinking left open?), the system
turn (the ``<tools>`` the Qwen3 template renders there), a trailing opened
``<tool_call>`` (how the gateway forces a tool choice), and the last user turn.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from engine.backends.sim.tokenizer import special_token_id

_TAIL_WINDOW = 8  # prompt tokens decoded to find the generation prompt (3 tokens in Qwen3)
_CHATML_START = "<|im_start|>"
_CHATML_END = "<|im_end|>"
_GENERATION_PROMPT = "<|im_start|>assistant\n"
_USER_ROLE = "user\n"
_SYSTEM_ROLE = "system\n"
_TOOLS_OPEN = "<tools>\n"
_TOOLS_CLOSE = "\n</tools>"
TOOL_CALL_START = "<tool_call>"
_TOOL_CALL_END = "</tool_call>"
_OPEN_CALL_WINDOW = 64
_TOOL_RESPONSE_OPEN = "<tool_response>\n"
_TOOL_RESPONSE_CLOSE = "\n</tool_response>"


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    thinking_open: bool
    tools: tuple[dict[str, Any], ...]
    open_call: str | None = None
    """Text after a trailing `<tool_call>` the prompt leaves open (a forced tool choice)."""


class PromptReader:
    """Reads ChatML structure from prompt ids, decoding only the few tokens it needs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # -1 never occurs in a checked prompt, so a tokenizer without ChatML matches nothing.
        self._start = special_token_id(tokenizer, _CHATML_START)
        self._end = special_token_id(tokenizer, _CHATML_END)
        self._call_start = special_token_id(tokenizer, TOOL_CALL_START)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def read(self, ids: list[int]) -> Prompt:
        chatml = self._start in ids
        tail = self.decode(ids[-_TAIL_WINDOW:]) if chatml else ""
        return Prompt(
            ids=ids,
            thinking_open=tail.endswith(_GENERATION_PROMPT),
            tools=self._tools(ids),
            open_call=self._open_call(ids),
        )

    def _open_call(self, ids: list[int]) -> str | None:
        """A prompt ending inside a tool call (the gateway forces `tool_choice` this way)."""
        window = ids[-_OPEN_CALL_WINDOW:]
        if self._call_start not in window:
            return None
        position = len(window) - 1 - window[::-1].index(self._call_start)
        text = self.decode(window[position + 1 :])
        return None if _TOOL_CALL_END in text or _CHATML_END in text else text

    def last_user_text(self, ids: list[int]) -> str:
        """The last user turn's text; the whole prompt's text when it is not ChatML."""
        for position in range(len(ids) - 1, -1, -1):
            if ids[position] == self._start:
                turn = self.decode(ids[position + 1 : self._turn_end(ids, position)])
                if turn.startswith(_USER_ROLE):
                    return turn[len(_USER_ROLE) :]
        return self.decode(ids) if self._start not in ids else ""

    def _turn_end(self, ids: list[int], start: int) -> int:
        try:
            return ids.index(self._end, start)
        except ValueError:
            return len(ids)

    def _tools(self, ids: list[int]) -> tuple[dict[str, Any], ...]:
        # The chat template puts the tool list in the system turn, which comes first.
        if not ids or ids[0] != self._start:
            return ()
        system = self.decode(ids[1 : self._turn_end(ids, 0)])
        if not system.startswith(_SYSTEM_ROLE):
            return ()
        return _parse_tools(system)


@functools.lru_cache(maxsize=64)  # load tests resend one system prompt over and over
def _parse_tools(system: str) -> tuple[dict[str, Any], ...]:
    opened = system.find(_TOOLS_OPEN)
    closed = system.find(_TOOLS_CLOSE, opened)
    if opened < 0 or closed < 0:
        return ()
    tools: list[dict[str, Any]] = []
    for line in system[opened + len(_TOOLS_OPEN) : closed].splitlines():
        tool = _tool_of(line)
        if tool is not None:
            tools.append(tool)
    return tuple(tools)


def tool_results(turn: str) -> list[str]:
    """The texts of a user turn's `<tool_response>` blocks (the Qwen3 template's tool messages)."""
    results: list[str] = []
    start = turn.find(_TOOL_RESPONSE_OPEN)
    while start >= 0:
        end = turn.find(_TOOL_RESPONSE_CLOSE, start)
        if end < 0:
            break
        results.append(turn[start + len(_TOOL_RESPONSE_OPEN) : end].strip())
        start = turn.find(_TOOL_RESPONSE_OPEN, end)
    return results


def _tool_of(line: str) -> dict[str, Any] | None:
    """A tool line as {"name", "parameters"}, from OpenAI's wrapped form or a bare function."""
    try:
        tool = json.loads(line)
    except ValueError:
        return None
    if not isinstance(tool, dict):
        return None
    function = tool.get("function") if tool.get("type") == "function" else tool
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return function
