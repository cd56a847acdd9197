"""Values typed by a tool's JSON schema: the one implementation of vLLM's rules.

XML-style tool calls (`<parameter=days>\\n3\\n</parameter>`) carry each value as
raw text; the JSON type comes from the offered tool's `parameters` schema. JSON
formats (`json_arguments`) retype string members with the same rules, because
vLLM's `ParserEngine._fix_arg_types` calls the same `coerce_to_schema_type`.
These are the rules vLLM 0.32 applies (`coerce_to_schema_type` and
`extract_types_from_schema` in `vllm/tool_parsers/utils.py`), reimplemented:

- the candidate types are the schema's `type` (a string or a list), the kinds
  of its `enum` values, and those of `anyOf`/`oneOf`/`allOf` branches, each
  lower-cased and mapped through a table of aliases (`int` → `integer`, ...);
  a schema that names none is `string`;
- candidates are tried in a fixed order, the first that parses wins:
  null (`"null"`, any case) > integer (Python `int()`) > number (`float()`,
  finite; integral values become ints) > boolean (`true`/`1`, `false`/`0`) >
  object / array (any finite JSON) > string (the text unchanged);
- when no candidate parses and `string` is not one of them, the text is read
  as JSON if it is finite JSON, else it stays a string.

A parameter the schema does not list, or a tool without properties, stays a
string. Only a value whose types are exactly `{string}` is known to be a
string before it is complete, so only those may stream character by character.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

STRING_ONLY = frozenset(("string",))

_ALIASES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "int": "integer",
    "int32": "integer",
    "int64": "integer",
    "uint": "integer",
    "uint32": "integer",
    "uint64": "integer",
    "long": "integer",
    "short": "integer",
    "unsigned": "integer",
    "float": "number",
    "float32": "number",
    "float64": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_BRANCHES = ("anyOf", "oneOf", "allOf")


def parameter_types(properties: Mapping[str, Any] | None, name: str) -> frozenset[str]:
    """The normalised candidate types of parameter `name`; `STRING_ONLY` when it stays text."""
    return schema_types(properties.get(name)) if properties else STRING_ONLY


def schema_types(schema: Any) -> frozenset[str]:
    """The normalised candidate types a schema allows; `STRING_ONLY` when it is not a schema."""
    return normalized(_declared_types(schema))


def normalized(types: Iterable[str]) -> frozenset[str]:
    """Type names as a schema writes them, lower-cased and mapped through the alias table."""
    return frozenset(_ALIASES.get(key, key) for key in (t.strip().lower() for t in types))


def _declared_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update(kind for kind in map(_kind, enum) if kind)
    for branch in _BRANCHES:
        choices = schema.get(branch)
        if isinstance(choices, list):
            for choice in choices:
                types |= _declared_types(choice)
    return types or {"string"}


def _kind(value: Any) -> str:
    """The JSON-schema type name of an `enum` value (bool before int: `True` is an int);
    a value that JSON cannot hold adds no type, as in vLLM."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string" if isinstance(value, str) else ""


def coerce(text: str, types: frozenset[str]) -> Any:
    """The JSON value of a parameter's text under its candidate types."""
    for kind in _ORDER:
        if kind in types:
            found, value = _try(kind, text)
            if found:
                return value
    return _json_or_text(text)


def _try(kind: str, text: str) -> tuple[bool, Any]:
    if kind == "string":
        return True, text
    if kind == "null":
        return text.lower() == "null", None
    if kind == "integer":
        try:
            return True, int(text)
        except ValueError:
            return False, None
    if kind == "number":
        return _number(text)
    if kind == "boolean":
        word = text.lower().strip()
        if word in ("true", "1"):
            return True, True
        return word in ("false", "0"), False
    return _json(text)


def _number(text: str) -> tuple[bool, Any]:
    try:
        value = float(text)
    except ValueError:
        return False, None
    if not math.isfinite(value):
        return False, None
    return True, (int(value) if value == int(value) else value)


def _json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, None
    return _finite(value), value


def _json_or_text(text: str) -> Any:
    found, value = _json(text)
    return value if found else text


def _finite(value: Any) -> bool:
    """JSON has no NaN or infinities: a value holding one cannot be written back."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True
