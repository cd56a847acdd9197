"""Incremental reader for one Hermes tool call body: `{"name": ..., "arguments": ...}`.

The body arrives in arbitrary fragments. A small JSON scanner tracks strings,
escapes and nesting depth so that, without ever re-reading earlier text, it
knows the tool name as soon as its string closes and can pass the raw text of
the `arguments` value through as it streams. The pieces of `arguments` joined
are exactly the model's JSON text for that value, so they parse whenever the
model's JSON does — for every chunking.

Per fragment the scanner jumps between structural characters with a regex and
copies the runs in between (O(len(fragment))).
"""

from __future__ import annotations

import json
import re

_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'[{}\[\]",:]')
_ARGUMENT_KEYS = frozenset(("arguments", "parameters"))

# What the scanner expects next at the top level of the object.
_KEY, _COLON, _VALUE, _COMMA = range(4)


class ToolCallBody:
    """State of one tool call body; feed text, then read `name` / `take_arguments()`."""

    __slots__ = (
        "_args_depth",
        "_args_out",
        "_buffer",
        "_depth",
        "_escape",
        "_expect",
        "_in_string",
        "_key",
        "_scalar",
        "_string_role",
        "arguments_done",
        "closed",
        "has_arguments",
        "name",
    )

    def __init__(self) -> None:
        self.name: str | None = None
        self.has_arguments = False
        self.arguments_done = False
        self.closed = False  # the top-level object has ended
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = _KEY
        self._key: str | None = None
        self._string_role = ""  # "key" | "name" | "" while in a string at depth 1
        self._buffer: list[str] = []  # raw chars of the current key or name string
        self._args_depth = -1  # depth the arguments value started at, -1 if not capturing
        self._args_out: list[str] = []
        self._scalar: list[str] | None = None  # a bare literal as the arguments value

    def take_arguments(self) -> str:
        """Arguments text streamed since the last call."""
        if not self._args_out:
            return ""
        out = "".join(self._args_out)
        self._args_out.clear()
        return out

    def feed(self, text: str) -> int:
        """Scan `text`; return how much of it the body took (less than all once the object closed)."""
        pos = 0
        end = len(text)
        while pos < end and not self.closed:
            pos = self._feed_string(text, pos) if self._in_string else self._feed_outside(text, pos)
        return pos

    def _feed_string(self, text: str, pos: int) -> int:
        if self._escape:
            self._escape = False
            self._plain(text[pos])
            return pos + 1
        match = _IN_STRING.search(text, pos)
        stop = match.start() if match else len(text)
        if stop > pos:
            self._plain(text[pos:stop])
        if match is None:
            return stop
        char = text[stop]
        self._plain(char)
        if char == "\\":
            self._escape = True
        else:
            self._in_string = False
            self._end_string()
        return stop + 1

    def _feed_outside(self, text: str, pos: int) -> int:
        match = _OUTSIDE.search(text, pos)
        stop = match.start() if match else len(text)
        if stop > pos:
            self._literal(text[pos:stop])
        if match is None:
            return stop
        self._structural(text[stop])
        return stop + 1

    def _capturing(self) -> bool:
        return self._args_depth >= 0

    def _plain(self, run: str) -> None:
        """Characters inside a string."""
        if self._capturing():
            self._args_out.append(run)
        elif self._string_role:
            self._buffer.append(run)

    def _literal(self, run: str) -> None:
        """Whitespace, numbers, true/false/null outside strings."""
        if self._capturing():
            self._args_out.append(run)
            return
        if self._depth == 1 and self._expect == _VALUE and self._key in _ARGUMENT_KEYS:
            stripped = run.strip()
            if stripped:
                self.has_arguments = True
                if self._scalar is None:
                    self._scalar = []
                self._scalar.append(stripped)

    def _structural(self, char: str) -> None:
        if self._capturing():
            self._args_out.append(char)
        if char == '"':
            self._start_string()
        elif char in "{[":
            self._open(char)
        elif char in "}]":
            self._close()
        elif self._depth == 1 and not self._capturing():
            if char == ":":
                self._expect = _VALUE
            elif char == ",":
                self._end_scalar()
                self._expect = _KEY

    def _start_string(self) -> None:
        self._in_string = True
        if self._depth != 1 or self._capturing():
            return
        if self._expect == _KEY:
            self._string_role = "key"
        elif self._expect == _VALUE and self._key == "name":
            self._string_role = "name"
        elif self._expect == _VALUE and self._key in _ARGUMENT_KEYS:
            self._begin_arguments('"')
            return
        self._buffer.clear()

    def _end_string(self) -> None:
        if self._capturing() and self._depth == self._args_depth:
            self._end_arguments()
            return
        role = self._string_role
        self._string_role = ""
        if not role:
            if self._depth == 1 and self._expect == _VALUE:
                self._expect = _COMMA
            return
        raw = "".join(self._buffer)[:-1]  # the closing quote was buffered
        self._buffer.clear()
        value = _json_string(raw)
        if role == "key":
            self._key = value
            self._expect = _COLON
        else:
            if self.name is None:
                self.name = value
            self._expect = _COMMA

    def _open(self, char: str) -> None:
        if self._depth == 1 and self._expect == _VALUE and self._key in _ARGUMENT_KEYS and not self._capturing():
            self._begin_arguments(char)
        self._depth += 1

    def _close(self) -> None:
        self._depth -= 1
        if self._capturing() and self._depth == self._args_depth:
            self._end_arguments()
        elif self._depth == 0:
            self._end_scalar()
            self.closed = True
        elif self._depth == 1:
            self._expect = _COMMA

    def _begin_arguments(self, opening: str) -> None:
        self.has_arguments = True
        self._args_depth = self._depth
        self._args_out.append(opening)

    def _end_arguments(self) -> None:
        self._args_depth = -1
        self.arguments_done = True
        self._expect = _COMMA

    def _end_scalar(self) -> None:
        if self._scalar is not None:
            self._args_out.append("".join(self._scalar))
            self._scalar = None
            self.arguments_done = True


def _json_string(raw: str) -> str:
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw
