"""Bounds on a structured-output constraint's size, depth and symbol count, checked before
any grammar library sees it (the gateway and the engine both check; the engine is reachable
directly).

Why (issue #27): llguidance compiles grammars and JSON schemas by recursion on the thread's
stack. A 58 KB Lark rule chain (`r0: r1`, `r1: r2`, ... about 2,700 rules deep) or a 94 KB
JSON schema whose `$ref`s chain 2,500 definitions overflows an 8 MiB stack and kills the
process with SIGSEGV; the depth that does it scales with the stack (about 1,000 rules on a
2 MiB thread). And a `choice` or grammar of more than 65,525 compiled symbols panics inside
the library (`grammar.symbols.len() < u16::MAX - 10`) after seconds of compiling. Real
constraints are far inside these bounds: schemas nest a handful of levels, Lark grammars a
few dozen rules. The checks are pure Python, iterative (no recursion of their own), and
stop counting as soon as a bound is passed.

Depth is measured as the compiler walks: for a JSON schema, the longest path through its
objects and arrays where a local `$ref` ("#/$defs/x") continues into its target; for a Lark
grammar, the longest chain of rule references (each rule weighing 1 + its bracket nesting);
for a regex, its bracket nesting. Recursion back into a rule or definition already on the
path is a cycle the compiler handles without recursing, so it adds nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from wire.protocol import StructuredOutputs


class GrammarLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The bounds one structured-output constraint must keep (past one: a 400 naming it)."""

    max_bytes: Annotated[int, Meta(ge=1)] = 131_072
    """Largest constraint in UTF-8 bytes: the schema's JSON, the regex, the grammar, or the choices."""
    max_depth: Annotated[int, Meta(ge=1)] = 128
    """Deepest nesting (see the module docstring); 2,000 levels crash the compiler on an 8 MiB stack."""
    max_symbols: Annotated[int, Meta(ge=1)] = 10_000
    """Most symbols: choices, grammar tokens (names, literals, regexes), or schema values.
    The library panics past 65,525 compiled symbols; 60,000 choices take 3 s to compile."""


class GrammarTooLarge(ValueError):
    """A constraint past a bound; the message names the bound and its config key."""


def check_grammar(constraint: StructuredOutputs, limits: GrammarLimits) -> None:
    """Raise `GrammarTooLarge` when `constraint` passes a bound of `limits`."""
    kind = constraint.kind
    if constraint.json is not None:
        text = constraint.json if isinstance(constraint.json, str) else json.dumps(constraint.json)
        _check_bytes(kind, text, limits)
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return  # not JSON: the compiler's own 400 says so
        _check_schema(kind, schema, limits)
    elif constraint.choice is not None:
        _check_bytes(kind, "".join(constraint.choice), limits)
        _check_count(kind, len(constraint.choice), "choices", limits)
    elif constraint.regex is not None:
        _check_bytes(kind, constraint.regex, limits)
        _check_depth(kind, _bracket_depth(constraint.regex), limits)
    elif constraint.grammar is not None:
        _check_bytes(kind, constraint.grammar, limits)
        _check_lark(kind, constraint.grammar, limits)
    elif constraint.structural_tag is not None:
        _check_bytes(kind, constraint.structural_tag, limits)


def _check_bytes(kind: str, text: str, limits: GrammarLimits) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarTooLarge(
            f"structured_outputs.{kind} is {size} bytes, more than the limit of {limits.max_bytes}"
            " (limits.grammar.max_bytes)"
        )


def _check_count(kind: str, count: int, what: str, limits: GrammarLimits) -> None:
    if count > limits.max_symbols:
        raise GrammarTooLarge(
            f"structured_outputs.{kind} holds more than {limits.max_symbols} {what},"
            " the limit (limits.grammar.max_symbols)"
        )


def _check_depth(kind: str, depth: int, limits: GrammarLimits) -> None:
    if depth > limits.max_depth:
        raise GrammarTooLarge(
            f"structured_outputs.{kind} nests more than {limits.max_depth} levels deep"
            " (counting $ref chains and rule references), the limit (limits.grammar.max_depth)"
        )


# ------------------------------------------------------------ longest path, iteratively


def _longest_path(roots: list[Any], edges: dict[Any, list[Any]], weight: dict[Any, int], most: int) -> int:
    """The heaviest path from any root through `edges`, skipping edges back onto the path
    (cycles), computed without recursion; stops early once it passes `most`."""
    done: dict[Any, int] = {}
    on_path: set[Any] = set()
    best = 0
    for root in roots:
        if root in done:
            continue
        stack: list[tuple[Any, Iterator[Any]]] = [(root, iter(edges.get(root, ())))]
        on_path.add(root)
        heaviest: dict[Any, int] = {root: 0}
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                done[node] = weight.get(node, 1) + heaviest.pop(node)
                if done[node] > most:
                    return done[node]
                if stack:
                    parent = stack[-1][0]
                    heaviest[parent] = max(heaviest[parent], done[node])
                continue
            if child in on_path:
                continue
            if child in done:
                heaviest[node] = max(heaviest[node], done[child])
                continue
            on_path.add(child)
            heaviest[child] = 0
            stack.append((child, iter(edges.get(child, ()))))
        best = max(best, done[root])
    return best


# ------------------------------------------------------------ JSON schema


def _check_schema(kind: str, schema: Any, limits: GrammarLimits) -> None:
    """Count the schema's values and walk its containers with `$ref`s as edges."""
    edges: dict[int, list[int]] = {}
    refs: list[tuple[int, str]] = []
    nodes: dict[int, Any] = {}
    count = 0
    pending = [schema]
    while pending:
        value = pending.pop()
        count += 1
        if count > limits.max_symbols:
            _check_count(kind, count, "schema values", limits)
        if not isinstance(value, dict | list):
            continue
        nodes[id(value)] = value
        children = list(value.values()) if isinstance(value, dict) else value
        edges[id(value)] = [id(child) for child in children if isinstance(child, dict | list)]
        pending.extend(children)
        if isinstance(value, dict) and isinstance(value.get("$ref"), str):
            refs.append((id(value), value["$ref"]))
    for source, pointer in refs:
        target = _resolve(schema, pointer)
        if target is not None and id(target) in nodes:
            edges[source].append(id(target))
    depth = _longest_path([id(schema)], edges, {}, limits.max_depth)
    _check_depth(kind, depth, limits)


def _resolve(schema: Any, pointer: str) -> Any:
    """The value a local JSON pointer (`#/$defs/name`) names, or None."""
    if not pointer.startswith("#"):
        return None
    value = schema
    for part in pointer[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


# ------------------------------------------------------------ Lark grammar, regex

# A Lark grammar's tokens: comments and whitespace (dropped), string literals, /regexes/,
# names, and single punctuation. A rule starts a line as `name:` or `name ::=` (GBNF form),
# optionally with Lark's `?`/`!` prefix and `.priority`.
_LARK_TOKEN = re.compile(
    r"""(?P<skip>\s+|//[^\n]*|\#[^\n]*)
      | (?P<literal>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*')
      | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_RULE_START = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)
_OPEN, _CLOSE = "([{", ")]}"


def _check_lark(kind: str, grammar: str, limits: GrammarLimits) -> None:
    starts = [(match.start(), match.group(1)) for match in _RULE_START.finditer(grammar)]
    rules = {name for _, name in starts}
    edges: dict[str, list[str]] = {}
    weight: dict[str, int] = {}
    symbols = 0
    bounds = [position for position, _ in starts[1:]] + [len(grammar)]
    # Not strict: a grammar without rules has one bound and no start, and nothing to check.
    for (start, name), end in zip(starts, bounds, strict=False):
        body = grammar[grammar.index(":", start) + 1 : end]
        nesting = deepest = 0
        for token in _LARK_TOKEN.finditer(body):
            group = token.lastgroup
            if group == "skip":
                continue
            text = token.group()
            symbols += 1
            if symbols > limits.max_symbols:
                _check_count(kind, symbols, "symbols", limits)
            if group == "name" and text in rules:
                edges.setdefault(name, []).append(text)
            elif text in _OPEN:
                nesting += 1
                deepest = max(deepest, nesting)
            elif text in _CLOSE:
                nesting -= 1
        weight[name] = max(weight.get(name, 1), 1 + deepest)
    roots = [name for _, name in starts]
    _check_depth(kind, _longest_path(roots, edges, weight, limits.max_depth), limits)


def _bracket_depth(text: str) -> int:
    """How deep `(`, `[` and `{` nest in a regex (escaped ones not counted)."""
    nesting = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in _OPEN:
            nesting += 1
            deepest = max(deepest, nesting)
        elif char in _CLOSE:
            nesting -= 1
    return deepest
