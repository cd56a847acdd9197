"""Narrow a value to the type a test expects, checked when it runs: one member of a union the
SDK's models allow (an output item of many kinds, an event of many, an answer or a stream)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def of(kind: type[T], value: object) -> T:
    """`value` as a `kind`; a test that meets anything else fails here, naming both."""
    assert isinstance(value, kind), f"expected {kind.__name__}, got {type(value).__name__}: {value!r}"
    return value

