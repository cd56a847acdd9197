"""Closing a tool call's JSON arguments that the output cut (`max_tokens`, EOS mid-call).

A family streams a call's arguments as the model writes them; when the output
ends inside the call, the text streamed so far is a JSON prefix. Clients parse
arguments (Anthropic's `tool_use.input` must be an object), so at finish the
chat choice appends one more arguments delta that closes it, and the
non-streamed message, the fold of the same deltas, carries the same text.
Nothing streamed is ever taken back, so the closing is a suffix:

- an open string is closed (a dangling `\\` completes as `\\\\`, a short
  `\\uXY` is padded with `0`s); an open key gets `: null`;
- a member whose value never started gets `null`;
- a cut literal is completed (`tr` → `true`), a number missing its digits
  gets a `0` (`-`, `1.`, `1e+`);
- open arrays and objects are closed in order;
- a comma with nothing after it yet is held back while streaming (released
  when the next member starts) and dropped at the cut, so no member is made up;
- no argument text at all gives `{}`.

Text that is not a JSON prefix as written (the model's own mistake) is passed
through and not closed: no suffix can make it valid. Each character is looked
at once (strings skip to the next quote or backslash), so feeding is O(delta).

States: VALUE (a value may start), KEY (a key may start), STRING (in a string;
`_key` says whether it is a key), ESCAPE (after a backslash, `_hex` digits of
a `\\u` still due), COLON (after a key), NUMBER (`_number` says what it still
needs), LITERAL (`_literal` holds the rest of `true`/`false`/`null`), AFTER (a
value ended), DONE (the top-level value ended), BROKEN (not JSON).
"""

from __future__ import annotations

import re

_VALUE, _KEY, _STRING, _ESCAPE, _COLON, _NUMBER, _LITERAL, _AFTER, _DONE, _BROKEN = range(10)

_STRING_STOP = re.compile(r'["\\]')
_WHITESPACE = frozenset(" \t\n\r")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSERS = {"{": "}", "[": "]"}

# What a number still needs: nothing (it may end here) or a digit.
_NUM_SIGN, _NUM_ZERO, _NUM_INT, _NUM_DOT, _NUM_FRAC, _NUM_E, _NUM_ESIGN, _NUM_EXP = range(8)
_NUM_NEEDS_DIGIT = frozenset((_NUM_SIGN, _NUM_DOT, _NUM_E, _NUM_ESIGN))


class JsonCloser:
    """One call's arguments text: `feed` what the family streamed, `close` at the cut."""

    __slots__ = ("_comma", "_held", "_hex", "_key", "_literal", "_number", "_seen", "_stack", "_state")

    def __init__(self) -> None:
        self._state = _VALUE
        self._stack: list[str] = []  # the open `{` / `[`, innermost last
        self._key = False
        self._hex = 0
        self._number = _NUM_INT
        self._literal = ""
        self._held = ""  # a comma and the whitespace after it, not yet streamed
        self._comma = False  # the state is KEY/VALUE right after a comma
        self._seen = False  # any non-whitespace text arrived

    def feed(self, text: str) -> str:
        """The part of `text` that may be streamed now (a trailing comma is held)."""
        state = self._state
        if state == _BROKEN or (state == _STRING and _STRING_STOP.search(text) is None):
            return text  # hot path: a delta inside a string value (most of a long argument)
        pos, end = 0, len(text)
        comma_at = -1 if self._held else -2  # -1: the comma is in `_held`; -2: none pending
        while pos < end:  # hot loop over argument text
            state = self._state
            if state == _BROKEN:
                break
            if state == _STRING:
                match = _STRING_STOP.search(text, pos)
                if match is None:
                    break
                pos = match.end()
                if match.group() == "\\":
                    self._state, self._hex = _ESCAPE, 0
                else:
                    self._end_string()
                continue
            char = text[pos]
            pos += 1
            if char in _WHITESPACE and state != _ESCAPE and state != _LITERAL:
                if state == _NUMBER:
                    self._end_scalar()
                continue
            if comma_at != -2:
                comma_at = -2  # the next member started: the comma stands
            if state == _ESCAPE:
                self._escape(char)
            elif state == _NUMBER and self._in_number(char):
                continue
            elif state == _LITERAL:
                self._in_literal(char)
            else:
                if state == _NUMBER:
                    self._end_scalar()
                if self._structural(char) and self._comma:
                    comma_at = pos - 1
        if comma_at == -2:
            out, self._held = self._held + text, ""
            return out
        if comma_at == -1:
            self._held += text
            return ""
        out, self._held = self._held + text[:comma_at], text[comma_at:]
        return out

    def close(self) -> str:
        """The suffix that makes everything streamed valid JSON; `""` when it already is (or never can be)."""
        state = self._state
        if state in (_BROKEN, _DONE):
            return ""
        if not self._seen:
            return "{}"
        parts: list[str] = []
        if state == _ESCAPE:
            parts.append("0" * self._hex if self._hex else "\\")
            state = _STRING
        if state == _STRING:
            parts.append('"')
            state = _COLON if self._key else _AFTER
        elif state == _NUMBER:
            if self._number in _NUM_NEEDS_DIGIT:
                parts.append("0")
        elif state == _LITERAL:
            parts.append(self._literal)
        if state == _COLON:
            parts.append(": null")
        elif state == _VALUE and not self._comma and self._stack and self._stack[-1] == "{":
            parts.append("null")  # after a colon
        parts.extend(_CLOSERS[bracket] for bracket in reversed(self._stack))
        return "".join(parts)

    # -- one character outside strings ------------------------------------

    def _structural(self, char: str) -> bool:
        """Take one character where a value, key or separator may be; True when it was a comma."""
        state = self._state
        self._seen = True
        if state == _VALUE:
            self._begin_value(char)
        elif state == _KEY:
            if char == '"':
                self._state, self._key, self._comma = _STRING, True, False
            elif char == "}" and not self._comma:
                self._close_container("{")
            else:
                self._state = _BROKEN
        elif state == _COLON:
            self._state = _VALUE if char == ":" else _BROKEN
        elif state == _AFTER:
            if char == ",":
                self._state = _KEY if self._stack[-1] == "{" else _VALUE
                self._comma = True
                return True
            self._close_container("{" if char == "}" else "[" if char == "]" else "")
        else:  # DONE: text after the top-level value
            self._state = _BROKEN
        return False

    def _begin_value(self, char: str) -> None:
        comma, self._comma = self._comma, False
        if char == '"':
            self._state, self._key = _STRING, False
        elif char in "{[":
            self._stack.append(char)
            self._state = _KEY if char == "{" else _VALUE
        elif char == "]" and not comma and self._stack and self._stack[-1] == "[" and self._state == _VALUE:
            self._close_container("[")  # an empty array
        elif char in _LITERALS:
            self._state, self._literal = _LITERAL, _LITERALS[char]
        elif char == "-":
            self._state, self._number = _NUMBER, _NUM_SIGN
        elif char == "0":
            self._state, self._number = _NUMBER, _NUM_ZERO
        elif "1" <= char <= "9":
            self._state, self._number = _NUMBER, _NUM_INT
        else:
            self._state = _BROKEN

    def _close_container(self, bracket: str) -> None:
        if not self._stack or self._stack[-1] != bracket:
            self._state = _BROKEN
            return
        self._stack.pop()
        self._state = _AFTER if self._stack else _DONE

    def _end_string(self) -> None:
        if self._key:
            self._state = _COLON
        else:
            self._end_scalar()

    def _end_scalar(self) -> None:
        if self._state == _NUMBER and self._number in _NUM_NEEDS_DIGIT:
            self._state = _BROKEN
            return
        self._state = _AFTER if self._stack else _DONE

    # -- inside an escape, a number, a literal ----------------------------

    def _escape(self, char: str) -> None:
        if self._hex:
            if char not in _HEX:
                self._state = _BROKEN
                return
            self._hex -= 1
            if not self._hex:
                self._state = _STRING
        elif char == "u":
            self._hex = 4
        else:
            self._state = _STRING

    def _in_number(self, char: str) -> bool:
        """Whether `char` continues the number (False: the number ended before it)."""
        number = self._number
        if "0" <= char <= "9":
            if number in (_NUM_SIGN, _NUM_INT):
                self._number = _NUM_INT if char != "0" or number == _NUM_INT else _NUM_ZERO
            elif number in (_NUM_DOT, _NUM_FRAC):
                self._number = _NUM_FRAC
            elif number in (_NUM_E, _NUM_ESIGN, _NUM_EXP):
                self._number = _NUM_EXP
            else:
                self._state = _BROKEN  # a digit after a leading zero
            return True
        if char == "." and number in (_NUM_ZERO, _NUM_INT):
            self._number = _NUM_DOT
        elif char in "eE" and number in (_NUM_ZERO, _NUM_INT, _NUM_FRAC):
            self._number = _NUM_E
        elif char in "+-" and number == _NUM_E:
            self._number = _NUM_ESIGN
        else:
            return False
        return True

    def _in_literal(self, char: str) -> None:
        if char != self._literal[0]:
            self._state = _BROKEN
            return
        self._literal = self._literal[1:]
        if not self._literal:
            self._end_scalar()
