"""The free text of a custom tool's call (OpenAI's Responses API): the model writes it as the
chat call's `{"input": "..."}` arguments; this reads it back, whole (`custom_input`) or as
it is written (`CustomInputStream`, for the `custom_tool_call_input.delta` events)."""

from __future__ import annotations

import json
import re
from typing import Literal

_LENIENT = json.JSONDecoder(strict=False)  # a raw line break inside a string: models write them
_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_OPENING_COMPACT = '{"input":"'
_SPECIAL = re.compile(r'["\\]')


class CustomInputStream:
    """The text of a custom tool's `{"input": "..."}` arguments, decoded as the model writes
    them, for `response.custom_tool_call_input.delta` (hot: once per argument delta).

    Arguments that do not open so are not streamed (`feed` gives nothing); their text comes
    whole when the call ends. An escape cut by a delta is held until it is whole."""

    def __init__(self) -> None:
        self._state: Literal["head", "text", "done", "whole"] = "head"
        self._held = ""

    def feed(self, piece: str) -> str:
        if self._state == "head":
            return self._head(piece)
        if self._state == "text":
            return self._text(piece)
        return ""

    def _head(self, piece: str) -> str:
        self._held += piece
        compact = re.sub(r"\s+", "", self._held)
        if _OPENING_COMPACT.startswith(compact):
            return ""  # not all of the opening yet
        opened = _OPENING.match(self._held)
        if opened is None:
            self._state, self._held = "whole", ""
            return ""
        self._state, rest, self._held = "text", self._held[opened.end():], ""
        return self._text(rest)

    def _text(self, piece: str) -> str:
        data, end = self._held + piece, 0
        while (found := _SPECIAL.search(data, end)) is not None:
            at = found.start()
            if data[at] == '"':  # the string's end: what follows is not input
                self._state = "done"
                return self._decode(data[:at])
            length = _escape_length(data, at)
            if at + length > len(data):  # cut by this delta: wait for the rest
                self._held = data[at:]
                return self._decode(data[:at])
            end = at + length
        self._held = ""
        return self._decode(data)

    def _decode(self, text: str) -> str:
        try:
            return str(_LENIENT.decode(f'"{text}"'))
        except ValueError:  # not JSON after all: the whole text comes at the end
            self._state = "whole"
            return ""


def _escape_length(data: str, at: int) -> int:
    """How long the escape at `at` is (`\\n` 2, `\\u00e9` 6, a surrogate pair 12); it may run
    past the end of `data`, which then holds only its start."""
    if at + 1 >= len(data):
        return 2
    if data[at + 1] != "u":
        return 2
    high = data[at + 2 : at + 6]
    if len(high) < 4:
        return 6
    return 12 if high[:2].lower() == "d8" or high[:2].lower() in ("d9", "da", "db") else 6


def custom_input(arguments: str) -> str:
    """The free text of a custom tool's call: its `input` argument, or the arguments as they
    are when the model did not write that object."""
    try:
        value = _LENIENT.decode(arguments)
    except ValueError:
        return arguments
    text = value.get("input") if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments
