"""Every family whose calls follow content: whitespace right before a call is dropped (issue #27).

vLLM's non-streamed answer strips the content before a call; onehop gives that
in both shapes by holding trailing whitespace until the next text decides:
more content releases it, a call drops it. Harmony is left out (its content and
calls are separate messages), and so are Llama's JSON and Python lists, which
are calls only when they open the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from derender.parsers.base import ToolCallText
from tests.support.families import FAMILIES, Family, family
from tests.support.streams import comparable_response, fixed, random_splits, stream, whole

CALL_AFTER_CONTENT = [name for name in FAMILIES if name not in ("openai", "llama3_json", "pythonic")]


@pytest.fixture(scope="module", params=CALL_AFTER_CONTENT)
def fam(request: Any, qwen3_tokenizer_dir: Path) -> Family:
    return family(request.param, qwen3_tokenizer_dir)


def answer(fam: Family, text: str, call: bool) -> dict[str, Any]:
    """Content `text`, then a call if `call` (no EOS: the output ends on the call), as the non-streamed
    answer, checked equal to the streams."""
    options = fam.options(reasoning=False)
    ids = fam.ids(text) + (fam.char_ids(fam.format_calls([ToolCallText("f", {"a": 1})])) if call else [])
    reference = comparable_response(whole(fam.vocab, options, ids, finish_reason="length"))
    for sizes in (fixed(1), fixed(3), random_splits(5)):
        assert stream(fam.vocab, options, ids, sizes, finish_reason="length").folded.as_comparable() == reference
    return reference


@pytest.mark.parametrize("space", ["\n\n", " ", " \n \t"])
def test_whitespace_right_before_a_call_is_dropped(fam: Family, space: str) -> None:
    got = answer(fam, f"Sure.{space}", call=True)
    assert (got["content"], len(got["tool_calls"])) == ("Sure.", 1)


def test_whitespace_stays_when_content_goes_on_or_ends(fam: Family) -> None:
    assert answer(fam, "Sure.\n\nMore \n text.", call=False)["content"] == "Sure.\n\nMore \n text."
    assert answer(fam, "Sure.\n\n", call=False)["content"] == "Sure.\n\n"
