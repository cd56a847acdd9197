"""`JsonCloser`: any JSON prefix, fed in any chunking, closes to valid JSON by a suffix."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from derender.parsers.json_close import JsonCloser

VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=3), inner, max_size=4)),
    max_leaves=10,
)
DUMPS = st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False}])


def closed(prefix: str, seed: int) -> tuple[str, str]:
    """(what streamed, what streamed + the closing) for `prefix` fed in random pieces."""
    rng = random.Random(seed)
    closer, out, pos = JsonCloser(), [], 0
    while pos < len(prefix):
        width = rng.randint(1, 4)
        out.append(closer.feed(prefix[pos : pos + width]))
        pos += width
    streamed = "".join(out)
    return streamed, streamed + closer.close()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(value=VALUES, dumps=DUMPS, seed=st.integers(0, 1000))
def test_every_prefix_closes(value: Any, dumps: dict[str, Any], seed: int) -> None:
    text = json.dumps(value, **dumps)
    for cut in range(len(text) + 1):
        streamed, whole = closed(text[:cut], seed + cut)
        assert text.startswith(streamed)  # nothing but a held comma is ever held back
        json.loads(whole)
    assert closed(text, seed) == (text, text)  # complete JSON: nothing held, nothing added


@pytest.mark.parametrize(
    ("prefix", "streamed", "closing"),
    [
        ("", "", "{}"),
        ("  ", "  ", "{}"),
        ('{"a": tr', '{"a": tr', "ue}"),
        ('{"a": 1,', '{"a": 1', "}"),  # the comma is held, then dropped: no member is made up
        ('{"a": 1, ', '{"a": 1', "}"),
        ("[1, 2,", "[1, 2", "]"),
        ('{"a', '{"a', '": null}'),
        ('{"a":', '{"a":', "null}"),
        ('{"s": "ab\\', '{"s": "ab\\', '\\"}'),
        ('{"s": "\\u12', '{"s": "\\u12', '00"}'),
        ('{"n": -', '{"n": -', "0}"),
        ('{"n": 1.', '{"n": 1.', "0}"),
        ('{"n": 1e+', '{"n": 1e+', "0}"),
        ('{"a": [{"b": [', '{"a": [{"b": [', "]}]}"),
        ('{"a": 1} ', '{"a": 1} ', ""),
        ('{"a": x', '{"a": x', ""),  # not JSON as written: passed through, not closed
        ('{"a": 1} x', '{"a": 1} x', ""),
    ],
)
def test_closing_rules(prefix: str, streamed: str, closing: str) -> None:
    closer = JsonCloser()
    assert closer.feed(prefix) == streamed
    assert closer.close() == closing


def test_a_held_comma_is_released_when_the_next_member_starts() -> None:
    closer = JsonCloser()
    assert [closer.feed(t) for t in ('{"a": 1', ",", " ", '"b', '": 2}')] == ['{"a": 1', "", "", ', "b', '": 2}']
    assert closer.close() == ""
