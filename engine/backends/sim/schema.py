"""Values from JSON schema: a tool call's arguments, and structured outputs' answers.

`constrained_text` writes what auto mode answers a constraint with (`SIM_CONSTRAINTS`):
a schema instance, one of the choices, or a JSON object. `fake_arguments` fills a tool's
``parameters``. Both follow the simple parts of JSON schema (`_SchemaFaker`).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from engine.backends.base import BackendRequestError
from engine.backends.sim.words import phrase
from wire.protocol import StructuredOutputs

SIM_CONSTRAINTS = frozenset({"json", "json_object", "choice"})
"""What auto mode writes to order: a schema instance, a JSON object, one of the choices."""
_MAX_SCHEMA_DEPTH = 4
_MAX_INSTANCE_DEPTH = 16


def constrained_text(constraint: StructuredOutputs, rng: random.Random) -> str:
    """What auto mode writes for a structured-output constraint (`SIM_CONSTRAINTS`)."""
    if constraint.choice is not None:
        if not constraint.choice:
            raise BackendRequestError("structured_outputs.choice must not be empty")
        return constraint.choice[rng.randrange(len(constraint.choice))]
    if constraint.json is not None:
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise BackendRequestError(f"structured_outputs.json is not a JSON schema: {exc}") from exc
        if not isinstance(schema, dict):
            raise BackendRequestError("structured_outputs.json must be a JSON schema object")
        return json.dumps(_fake_instance(schema, rng), ensure_ascii=False)
    if constraint.json_object:
        return json.dumps({"answer": phrase(rng)})
    raise BackendRequestError(f"the sim backend cannot write structured_outputs.{constraint.kind}")


def fake_arguments(parameters: object, rng: random.Random) -> dict[str, Any]:
    """Arguments that satisfy the simple parts of a tool's `parameters` schema."""
    schema = parameters if isinstance(parameters, dict) else {"type": "object"}
    value = _SchemaFaker(schema, rng, _MAX_SCHEMA_DEPTH).value(schema, 0)
    return value if isinstance(value, dict) else {}


def _fake_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """An instance of a structured-output schema: every required property at any depth
    (up to `_MAX_INSTANCE_DEPTH`), `$ref`s into `$defs` resolved, common string formats."""
    return _SchemaFaker(schema, rng, _MAX_INSTANCE_DEPTH).value(schema, 0)


_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
}


class _SchemaFaker:
    """Values for the parts of JSON schema that tools and structured outputs use: `const`,
    `enum` (first value), `anyOf`/`oneOf`/`allOf` (first option), `$ref` into the root's
    `$defs`/`definitions`, and the types (objects with their required properties and about
    half of the optional ones, 1-2 array items or `minItems`, seeded numbers within bounds)."""

    def __init__(self, root: dict[str, Any], rng: random.Random, max_depth: int) -> None:
        self._root = root
        self._rng = rng
        self._max_depth = max_depth

    def value(self, schema: object, depth: int) -> Any:
        if not isinstance(schema, dict):
            return phrase(self._rng)
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.value(self._resolve(ref), depth + 1)  # a cycle of refs ends at max_depth
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[0]
        for key in ("anyOf", "oneOf", "allOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                return self.value(options[0], depth)
        kind = _schema_type(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            low, high = _bounds(schema)
            return self._rng.randint(math.ceil(low), max(math.ceil(low), math.floor(high)))
        if kind == "number":
            low, high = _bounds(schema)
            return round(self._rng.uniform(low, max(low, high)), 2)
        if kind == "boolean":
            return self._rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _resolve(self, ref: str) -> object:
        """`#/$defs/Name` (or `#/definitions/Name`, or `#` itself) in the root schema."""
        node: object = self._root
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
        return node

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        if depth >= self._max_depth:
            return {}
        declared = schema.get("properties")
        properties: dict[str, Any] = declared if isinstance(declared, dict) else {}
        listed = schema.get("required")
        required = [r for r in listed if isinstance(r, str)] if isinstance(listed, list) else []
        optional = [name for name in properties if name not in required and self._rng.random() < 0.5]
        return {name: self.value(properties.get(name, {}), depth + 1) for name in required + optional}

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        if depth >= self._max_depth:
            return []
        low, high = schema.get("minItems"), schema.get("maxItems")
        count = max(low if isinstance(low, int) else 0, self._rng.randint(1, 2))
        if isinstance(high, int):
            count = min(count, high)
        return [self.value(schema.get("items", {}), depth + 1) for _ in range(count)]

    def _string(self, schema: dict[str, Any]) -> str:
        known = schema.get("format")
        text = (_FORMATS.get(known) if isinstance(known, str) else None) or phrase(self._rng)
        longest = schema.get("maxLength")
        return text[:longest] if isinstance(longest, int) and longest > 0 else text


def _schema_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else "string"


def _bounds(schema: dict[str, Any]) -> tuple[float, float]:
    """`minimum`/`maximum`, or a range of 100 on the side that is missing."""
    low, high = _number(schema.get("minimum")), _number(schema.get("maximum"))
    if low is None:
        low = 0 if high is None or high >= 0 else high - 100
    return low, (low + 100 if high is None else high)


def _number(value: object) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
