"""A tool call's JSON arguments, streamed through and retyped by the tool's schema.

vLLM's engine-based parsers (Kimi K2 among them) fix value types against the
tool's JSON schema when they build the non-streamed answer: `"days": "3"` for an
integer parameter becomes `3`, `"metric": 1` for a boolean becomes `true`
(`ParserEngine._fix_arg_types`); their stream sends the model's text as is. onehop
streams what the non-streamed answer holds, so values that the schema may retype
are held until they close and then written retyped; everything else passes
through as it arrives. Only top-level members of an object are looked at, and a
member is held only when its schema can change it:

    LEAD --first non-space--> OBJECT (`{` and a schema) | PASS (anything else)
    OBJECT: KEY -> KEY_STRING -> COLON -> VALUE -> (raw | held) -> AFTER -> KEY | TAIL

A held value that never closes (the output was cut) is released as written (the
chat choice then closes the arguments: `json_close`). When
nothing but whitespace was written the arguments are `{}`, as vLLM's full answer has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from derender.parsers.typed_values import coerce, normalized, schema_types

_STRING_STOP = re.compile(r'["\\]')

# Scanner states.
_LEAD, _PASS, _KEY, _KEY_STRING, _COLON, _VALUE, _IN_VALUE, _AFTER, _TAIL = range(9)

_NOT_STRING = frozenset(("null", "integer", "number", "boolean", "object", "array"))


class ArgumentsText:
    """One call's arguments text: `feed` the model's text, `take` what may be streamed."""

    __slots__ = (
        "_depth",
        "_escape",
        "_held",
        "_in_string",
        "_key",
        "_lead",
        "_literal",
        "_out",
        "_prop",
        "_properties",
        "_state",
    )

    def __init__(self, properties: Mapping[str, Any] | None) -> None:
        self._properties = properties or None
        self._out: list[str] = []
        self._lead: list[str] = []
        self._state = _LEAD
        self._key: list[str] = []
        self._prop: Mapping[str, Any] | None = None
        self._held: list[str] | None = None  # the current value's text while it is held
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._literal = False

    def take(self) -> str:
        """Text that may be streamed since the last call."""
        out = self._out
        if not out:
            return ""
        self._out = []
        return "".join(out)

    def feed(self, text: str) -> None:
        if self._state == _PASS:
            self._out.append(text)
            return
        if self._state == _LEAD:
            text = self._leave_lead(text)
            if not text:
                return
            if self._state == _PASS:
                self._out.append(text)
                return
        self._scan(text)

    def finish(self) -> None:
        """The call ended: release a held value as written; no arguments at all are `{}`."""
        if self._state == _LEAD:
            self._out.append("{}")
        elif self._held is not None:
            self._out.extend(self._held)
            self._held = None

    # -- top level ----------------------------------------------------------

    def _leave_lead(self, text: str) -> str:
        body = text.lstrip()
        if not body:
            self._lead.append(text)
            return ""
        self._out.extend(self._lead)
        self._lead = []
        self._state = _KEY if self._properties is not None and body[0] == "{" else _PASS
        if self._state == _KEY:
            self._out.append(text[: len(text) - len(body) + 1])
            return body[1:]
        return text

    def _scan(self, text: str) -> None:
        pos, end = 0, len(text)
        while pos < end:  # hot loop over argument text
            state = self._state
            if state == _IN_VALUE:
                pos = self._value(text, pos)
            elif state == _KEY_STRING:
                pos = self._key_string(text, pos)
            elif state == _TAIL:
                self._out.append(text[pos:])
                return
            elif state == _VALUE and not text[pos].isspace():
                self._begin_value(text[pos])  # the character is scanned as the value's first
            else:
                self._structural(text[pos])
                pos += 1

    def _structural(self, char: str) -> None:
        """One character outside any value or key, at the top level of the object."""
        state = self._state
        self._out.append(char)
        if state == _KEY and char == '"':
            self._state = _KEY_STRING
            self._key = []
        elif state in (_KEY, _AFTER) and char == "}":
            self._state = _TAIL
        elif state == _AFTER and char == ",":
            self._state = _KEY
        elif state == _COLON and char == ":":
            self._state = _VALUE

    def _key_string(self, text: str, pos: int) -> int:
        if self._escape:
            self._escape = False
            self._out.append(text[pos])
            self._key.append(text[pos])
            return pos + 1
        match = _STRING_STOP.search(text, pos)
        stop = match.start() if match else len(text)
        run = text[pos : stop + (1 if match else 0)]
        self._out.append(run)
        if match is None:
            self._key.append(run)
            return stop
        if text[stop] == "\\":
            self._escape = True
            self._key.append(run)
        else:
            self._key.append(run[:-1])
            self._state = _COLON
        return stop + 1

    # -- one member value ---------------------------------------------------

    def _begin_value(self, char: str) -> None:
        self._state = _IN_VALUE
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._literal = False
        prop = self._properties.get(_json_text(self._key)) if self._properties is not None else None
        self._prop = prop if isinstance(prop, Mapping) else None
        self._held = [] if self._prop is not None and _may_retype(self._prop, char) else None

    def _value(self, text: str, pos: int) -> int:
        """Scan the current value from `pos`; return where scanning goes on."""
        sink = self._out if self._held is None else self._held
        if self._in_string:
            if self._escape:
                self._escape = False
                sink.append(text[pos])
                return pos + 1
            match = _STRING_STOP.search(text, pos)
            stop = match.start() if match else len(text)
            sink.append(text[pos : stop + (1 if match else 0)])
            if match is None:
                return stop
            if text[stop] == "\\":
                self._escape = True
            else:
                self._in_string = False
                if self._depth == 0:
                    self._end_value()
            return stop + 1
        char = text[pos]
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]" and self._depth > 0:
            self._depth -= 1
            sink.append(char)
            if self._depth == 0:
                self._end_value()
            return pos + 1
        elif self._depth == 0 and (char in ",}]" or char.isspace()):
            if self._literal or char in ",}]":
                self._end_value()
                return pos  # the character belongs to the object, not the value
        elif self._depth == 0:
            self._literal = True
        sink.append(char)
        return pos + 1

    def _end_value(self) -> None:
        self._state = _AFTER
        held = self._held
        if held is None:
            return
        self._held = None
        raw = "".join(held)
        assert self._prop is not None
        self._out.append(_retyped(raw, self._prop))


def _json_text(raw_parts: list[str]) -> str:
    raw = "".join(raw_parts)
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw


def _may_retype(schema: Mapping[str, Any], first: str) -> bool:
    """Whether a value starting with `first` could come out of the schema fix-up changed."""
    if first == '"':
        types = schema_types(schema)
        return "string" not in types or not types.isdisjoint(_NOT_STRING)
    if first == "{":
        nested = schema.get("properties")
        return isinstance(nested, Mapping) and bool(nested)
    if first == "[":
        return isinstance(schema.get("items"), Mapping)
    return True


def _retyped(raw: str, schema: Mapping[str, Any]) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    value, changed = coerce_value(value, schema)
    return json.dumps(value, ensure_ascii=False) if changed else raw


# -- the schema fix-up: `ParserEngine._fix_arg_types`, walking the value -------------
# Strings are typed by `typed_values` (vLLM's `coerce_to_schema_type`, shared with the XML formats);
# what is JSON-only is the walk into objects and arrays and the retyping of non-string scalars.


def coerce_value(value: Any, schema: Mapping[str, Any]) -> tuple[Any, bool]:
    """`value` fixed up for `schema`, and whether it changed."""
    if isinstance(value, str):
        coerced = coerce(value, schema_types(schema))
        return (coerced, True) if coerced is not value else (value, False)
    if isinstance(value, dict):
        nested = schema.get("properties")
        return value, isinstance(nested, Mapping) and coerce_members(value, nested)
    if isinstance(value, list):
        items = schema.get("items")
        if not isinstance(items, Mapping):
            return value, False
        changed = False
        for i, item in enumerate(value):
            fixed, item_changed = coerce_value(item, items)
            if item_changed:
                value[i] = fixed
                changed = True
        return value, changed
    coerced = coerce(json.dumps(value, ensure_ascii=False), schema_types(schema))
    if type(coerced) is not type(value) or coerced != value:
        return coerced, True
    return value, False


def coerce_members(args: dict[str, Any], properties: Mapping[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if not isinstance(prop, Mapping):
            continue
        fixed, member_changed = coerce_value(value, prop)
        if member_changed:
            args[key] = fixed
            changed = True
    return changed


def coerce_text(value: str, types: set[str]) -> Any:
    """A string read as the first schema type it fits, `types` as a schema writes them."""
    return coerce(value, normalized(types))
