"""The grammar check process (`engine.backends.grammar_check`): a constraint that crashes
llguidance kills the check process, not the caller; one that compiles too slowly is cut off;
either way the next constraint is checked by a fresh process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from engine.backends.base import BackendRequestError
from engine.backends.grammar_check import GrammarCheck
from wire.protocol import StructuredOutputs
from tests.support.grammars import many_choices, ref_chain, rule_chain

pytest.importorskip("llguidance")

FINE = StructuredOutputs(grammar='start: "ab" | "cd"')


@pytest.fixture
async def check() -> AsyncIterator[GrammarCheck]:
    checker = GrammarCheck()
    await checker.start()
    try:
        yield checker
    finally:
        await checker.close()


@pytest.mark.parametrize("constraint", [StructuredOutputs(grammar=rule_chain(5000)), StructuredOutputs(json=ref_chain(2700))])
async def test_a_constraint_that_crashes_the_library_is_refused_and_the_next_is_checked(
    check: GrammarCheck, constraint: StructuredOutputs
) -> None:
    with pytest.raises(BackendRequestError, match="crashed the grammar compiler"):
        await check.check(constraint)
    await check.check(FINE)


async def test_an_invalid_constraint_is_refused_in_the_librarys_words(check: GrammarCheck) -> None:
    with pytest.raises(BackendRequestError, match=r"invalid structured_outputs\.regex"):
        await check.check(StructuredOutputs(regex="(a"))
    await check.check(FINE)


async def test_a_constraint_slower_than_the_timeout_is_cut_off(check: GrammarCheck) -> None:
    hasty = GrammarCheck(timeout_s=0.2)  # 60,000 choices take seconds
    try:
        with pytest.raises(BackendRequestError, match=r"did not compile within 0\.2 s"):
            await hasty.check(StructuredOutputs(choice=many_choices(60_000)))
    finally:
        await hasty.close()
    await check.check(FINE)
