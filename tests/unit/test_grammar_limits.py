"""The bounds on a structured-output constraint (`wire.grammar_limits`), on the inputs that
crashed or stalled llguidance (issue #27) and on constraints real clients send."""

from __future__ import annotations

import json
from typing import Any

import pytest

from wire.grammar_limits import GrammarLimits, GrammarTooLarge, check_grammar
from wire.protocol import StructuredOutputs
from tests.support.grammars import many_choices, ref_chain, rule_chain

LIMITS = GrammarLimits()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "home": {"$ref": "#/$defs/Address"},
        "friends": {"type": "array", "items": {"$ref": "#"}},  # recursive: a cycle, not depth
    },
    "required": ["name"],
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
LARK = """
start: item ("," item)*
item: NUMBER | "[" start? "]" | name
name: /[a-z]+/  // a comment with ( ( ( brackets
NUMBER: /[0-9]+/
"""


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": PERSON},
        {"json": json.dumps(PERSON)},
        {"grammar": LARK},
        {"grammar": rule_chain(100)},
        {"json": ref_chain(100)},
        {"choice": many_choices(10_000)},
        {"regex": "[0-9]{3}-(a|b(c|d))"},
        {"json_object": True},
    ],
)
def test_what_clients_send_is_within_the_bounds(constraint: dict[str, Any]) -> None:
    check_grammar(StructuredOutputs(**constraint), LIMITS)


@pytest.mark.parametrize(
    ("constraint", "bound"),
    [
        ({"grammar": rule_chain(5000)}, "limits.grammar.max_depth"),  # 58 KB: SIGSEGV on an 8 MiB stack
        ({"json": ref_chain(2700)}, "limits.grammar.max_depth"),  # 94 KB: SIGSEGV
        ({"json": json.dumps(ref_chain(2700))}, "limits.grammar.max_depth"),
        ({"choice": many_choices(66_000)}, "limits.grammar.max_bytes"),  # panics past 65,525 symbols
        ({"choice": many_choices(10_001)}, "limits.grammar.max_symbols"),
        ({"grammar": "start: " + " ".join(['"a"'] * 10_001)}, "limits.grammar.max_symbols"),
        ({"json": {"enum": list(range(10_001))}}, "limits.grammar.max_symbols"),
        ({"grammar": "start: " + "(" * 200 + '"a"' + ")" * 200}, "limits.grammar.max_depth"),
        ({"regex": "(" * 200 + "a" + ")" * 200}, "limits.grammar.max_depth"),
        ({"regex": "a" * 131_073}, "limits.grammar.max_bytes"),
    ],
)
def test_a_constraint_past_a_bound_is_refused_naming_it(constraint: dict[str, Any], bound: str) -> None:
    with pytest.raises(GrammarTooLarge, match=bound.replace(".", r"\.")):
        check_grammar(StructuredOutputs(**constraint), LIMITS)


def test_bounds_are_configurable() -> None:
    check_grammar(StructuredOutputs(grammar=rule_chain(500)), GrammarLimits(max_depth=1000))
    with pytest.raises(GrammarTooLarge, match="max_depth"):
        check_grammar(StructuredOutputs(grammar=rule_chain(20)), GrammarLimits(max_depth=10))
