"""Constraints that crashed or stalled llguidance (issue #27), built at any size.

`rule_chain(5000)` (a 58 KB Lark grammar) and `ref_chain(2700)` (a 94 KB JSON schema)
overflow the compiler's stack on an 8 MiB thread and kill the process (SIGSEGV);
`many_choices(66_000)` passes the library's 65,525-symbol bound and panics after seconds.
"""

from __future__ import annotations

from typing import Any


def rule_chain(rules: int) -> str:
    """A Lark grammar whose rules each name the next: `start: r0`, `r0: r1`, ... `"x"`."""
    lines = ["start: r0"] + [f"r{i}: r{i + 1}" for i in range(rules - 1)] + [f'r{rules - 1}: "x"']
    return "\n".join(lines)


def ref_chain(definitions: int) -> dict[str, Any]:
    """A JSON schema whose `$defs` each refer to the next; the last is a string."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(definitions - 1)}
    defs[f"d{definitions - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def many_choices(count: int) -> list[str]:
    return [f"option{i}" for i in range(count)]
