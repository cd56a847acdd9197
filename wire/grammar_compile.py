"""A structured-output constraint → its llguidance grammar, checked (torch-free, so the
grammar check child (`engine.backends.grammar_child`) starts in a fraction of a second, and
the gateway checks a custom tool's grammar with it without loading a backend).

The mapping follows vLLM's `guidance` backend: a JSON schema (whitespace between tokens
flexible unless `disable_any_whitespace`), `json_object` as the schema `{"type": "object"}`,
and `regex`, `choice` and `grammar` (Lark/EBNF) as llguidance reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

from wire.protocol import StructuredOutputs

CONSTRAINTS = frozenset({"json", "json_object", "regex", "choice", "grammar"})
"""What the hf backend enforces (vLLM's `structural_tag` is not mapped)."""

log = logging.getLogger("onehop.engine.grammar")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the client's fault. The backends raise it on as
    their `BackendRequestError` (a 400), with the same message."""


SHORT_ERROR_CHARS = 300
"""A library error as a client sees it: llguidance's panics carry a Rust backtrace of 70+
lines after their first (issue #27); that detail stays in the engine's log."""


def short_error(error: str) -> str:
    """The first line of a library error, at most SHORT_ERROR_CHARS long; when more was cut,
    the whole text goes to the engine's log under a hash the short form names."""
    text = error.strip()
    first = text.split("\n", 1)[0]
    if len(first) > SHORT_ERROR_CHARS:
        first = first[:SHORT_ERROR_CHARS] + "…"
    if first == text:
        return first
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    log.warning("grammar library error %s in full:\n%s", tag, text)
    return f"{first} (detail {tag} in the engine log)"


def compile_grammar(constraint: StructuredOutputs) -> str:
    """The llguidance grammar for a constraint, checked (a bad schema or regex is a GrammarError).

    Compiling recurses on the calling thread's stack: call it only where a crash cannot
    take the engine down (`grammar_check`), or after such a call passed on a smaller stack."""
    if constraint.kind not in CONSTRAINTS:
        raise GrammarError(f"the hf backend cannot enforce structured_outputs.{constraint.kind}")
    flexible: JsonCompileOptions = {"whitespace_flexible": not constraint.disable_any_whitespace}
    try:
        if constraint.json is not None:
            schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
            if constraint.disable_additional_properties:
                schema = _closed(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=flexible)
        elif constraint.json_object is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=flexible)
        elif constraint.choice is not None:
            grammar = llguidance.grammar_from("choice", json.dumps(constraint.choice))
        elif constraint.regex is not None:
            grammar = llguidance.grammar_from("regex", constraint.regex)
        else:
            assert constraint.grammar is not None
            grammar = llguidance.grammar_from("grammar", constraint.grammar)
    except (ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(f"invalid structured_outputs.{constraint.kind}: {short_error(str(exc))}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)  # "" when it is valid
    if error:
        raise GrammarError(f"invalid structured_outputs.{constraint.kind}: {short_error(error)}")
    return grammar


def _closed(schema: Any) -> Any:
    """`disable_additional_properties`: every object schema without its own rule admits no
    properties it does not declare (as vLLM's `process_for_additional_properties`)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
