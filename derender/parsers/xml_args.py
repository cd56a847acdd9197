"""XML-style tool-call parameters (`<parameter=NAME>value</parameter>`) as streaming arguments JSON.

`match_tag` matches a tag pattern at a position of text that may still be
growing (a partial match is reported, so only that much is held back);
`ArgsJson` writes one call's arguments as its values arrive: values whose
schema says string (or says nothing) stream piece by piece, others are typed
once complete (`typed_values`), and the fragments join to `json.dumps` of the
arguments vLLM 0.32 reports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from derender.parsers.typed_values import STRING_ONLY, coerce, parameter_types

NO, PARTIAL = -2, -1
WS = None
"""In a tag pattern: a run of whitespace (regex `\\s*`)."""
# What `\s` matches in the `regex` module vLLM's patterns use (Unicode White_Space;
# str.isspace() would also take the \x1c-\x1f separators).
_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))
)


def match_tag(text: str, pos: int, pattern: tuple[str | None, ...]) -> int:
    """End of `pattern` matched at `text[pos]`, `PARTIAL` if the text ends inside it, else `NO`."""
    end = len(text)
    for part in pattern:
        if part is None:
            while pos < end and text[pos] in _SPACE:
                pos += 1
            continue
        if pos >= end:
            return PARTIAL
        stop = pos + len(part)
        if text.startswith(part, pos):
            pos = stop
        elif stop > end and part.startswith(text[pos:]):
            return PARTIAL
        else:
            return NO
    return pos


class ArgsJson:
    """The arguments JSON of one call, written as its parameters arrive.

    Fragments go to `out`; joined they are `json.dumps` of the typed arguments
    (a repeated parameter is written again, so it parses to its last value).
    A key is written with the first character of its value, so a value cut off
    before any text arrived leaves nothing behind. `trim`: one leading and one
    trailing newline of each value are framing (Qwen3-Coder's template); False
    keeps values verbatim (MiniMax writes them inline).
    """

    __slots__ = (
        "_count",
        "_lead",
        "_name",
        "_newline",
        "_properties",
        "_trim",
        "_typed",
        "_types",
        "_written",
        "out",
    )

    def __init__(self, properties: Mapping[str, Any] | None, out: list[str], *, trim: bool = True) -> None:
        self.out = out
        self._trim = trim
        self._properties = properties
        self._count = 0
        self._name = ""
        self._types = STRING_ONLY
        self._typed: list[str] | None = None  # raw text of a value written only once complete
        self._written = False  # the open value's key (and opening quote) went out
        self._lead = trim  # the value's first text is still to come (and may start with framing)
        self._newline = False  # a trailing newline held back: it may be the closing framing

    def open(self, name: str) -> None:
        self._name = name
        self._types = parameter_types(self._properties, name)
        self._typed = None if self._types == STRING_ONLY else []
        self._written = False
        self._lead = self._trim
        self._newline = False

    def value(self, text: str) -> None:
        """More of the open value's text (never empty)."""
        if self._lead:
            self._lead = False
            if text[0] == "\n":
                text = text[1:]
                if not text:
                    return
        if self._newline:
            text = "\n" + text
            self._newline = False
        if text[-1] == "\n" and self._trim:
            self._newline = True
            text = text[:-1]
            if not text:
                return
        if self._typed is not None:
            self._typed.append(text)
            return
        if not self._written:
            self._key('"')
        self.out.append(json.dumps(text, ensure_ascii=False)[1:-1])

    def close(self, *, complete: bool) -> None:
        """The open value ended; `complete` when its closing tag (or the next opening) came.
        Its held trailing newline was framing either way."""
        typed = self._typed
        if typed is None:
            if self._written:
                self.out.append('"')
            elif complete:
                self._key('""')
            return
        self._typed = None
        if typed or complete:
            self._key(json.dumps(coerce("".join(typed), self._types), ensure_ascii=False))

    def finish(self) -> None:
        self.out.append("}" if self._count else "{}")

    def _key(self, then: str) -> None:
        lead = ", " if self._count else "{"
        self._count += 1
        self._written = True
        self.out.append(f"{lead}{json.dumps(self._name, ensure_ascii=False)}: {then}")
