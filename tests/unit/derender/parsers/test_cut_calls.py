"""Every family: a call cut by `max_tokens` closes to valid JSON, streamed and not (issue #27).

Random argument objects are written in each family's format, every character
outside a marker as its own token(s), and the output is cut after every token.
Each call of the answer must have arguments that parse to a JSON object; the
stream (one token per chunk, and a random chunking) must fold to exactly the
non-streamed answer, so the closing delta the stream sends at finish is the
same text the non-streamed arguments end with; `finish_reason` stays `length`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender.parsers.base import ToolCallText
from tests.support.families import FAMILIES, Family, family
from tests.support.streams import comparable_response, fixed, random_splits, stream, whole

SETTINGS = settings(
    max_examples=int(os.environ.get("ONEHOP_PROPERTY_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=not os.environ.get("ONEHOP_PROPERTY_RANDOM"),
)

KEYS = st.sampled_from(["city", "q", "n", "文", "a b", 'k"'])
STRINGS = st.text(alphabet=st.sampled_from([*'ab é🫠"\\\n/{}[],:', "\u2028"]), max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.floats(-1e6, 1e6, allow_nan=False), STRINGS)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(KEYS, VALUES, min_size=0, max_size=3)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request: Any, qwen3_tokenizer_dir: Path) -> Family:
    return family(request.param, qwen3_tokenizer_dir)


def cut_answer(fam: Family, ids: list[int], seed: int) -> dict[str, Any]:
    """The non-streamed answer to output cut after `ids`, checked equal to two chunkings' streams."""
    options = fam.options(chat_template_kwargs={"enable_thinking": False})
    reference = comparable_response(whole(fam.vocab, options, ids, finish_reason="length"))
    for sizes in (fixed(1), random_splits(seed, most=4)):
        folded = stream(fam.vocab, options, ids, sizes, finish_reason="length").folded
        assert folded.as_comparable() == reference
    return reference


@SETTINGS
@given(arguments=ARGUMENTS, seed=st.integers(0, 1000))
def test_a_cut_call_closes_to_a_json_object(fam: Family, arguments: dict[str, Any], seed: int) -> None:
    ids = fam.char_ids(fam.format_calls([ToolCallText("f", arguments)]))
    rng = random.Random(seed)
    for cut in range(1, len(ids) + 1):
        answer = cut_answer(fam, ids[:cut], rng.randrange(1000))
        assert answer["finish_reason"] == "length"
        for call in answer["tool_calls"]:
            assert isinstance(json.loads(call["arguments"]), dict), (cut, call)
