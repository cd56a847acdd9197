"""onehop's reasoning and tool parsing against vLLM 0.32's, family by family, through the parity oracle (opt-in).

Each family's cases (`tests/vllm/parity_cases/<family>.py`) are model output
encoded with the family's tokenizer after a prompt rendered with its template;
each runs through vLLM's coupled chat serving in-process
(`scripts/vllm_parse_oracle.py`, one oracle process for the test session, one
batch per family) and through onehop's derender, for every chunking of the case
and the non-streamed path.

Where the answers differ on purpose, or vLLM disagrees with itself, the case
carries a named `Deviation` with both sides' values: the test fails if either
side changes, so nothing is papered over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from tests.support import parity
from tests.support.parity import Lossy, parsed_json, reconcile
from tests.support.vllm_oracle import compare, onehop_full, vllm_python
from tests.vllm.parity_cases import (
    deepseek,
    glm,
    harmony,
    kimi_k2,
    llama3_json,
    minimax_m2,
    mistral,
    pythonic,
    qwen3_coder,
    qwen3_hermes,
)
from tests.vllm.parity_cases.family import Built, Counted, Family

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class Run:
    """A family's cases and vLLM's answer to each, by case name."""

    built: Built
    answers: dict[str, dict[str, Any]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`name`: each case of the test class's family."""
    if "name" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("name", list(metafunc.cls.family.cases))


class ParityTests:
    """The parity tests of one family (a `Test...` subclass names it)."""

    family: ClassVar[Family]

    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, request: pytest.FixtureRequest) -> Run:
        if vllm_python() is None:  # skip before building any tokenizer
            pytest.skip(parity.NO_VLLM)
        built = cls.family.build(request.getfixturevalue)
        return Run(built, parity.oracle_answers(built.cases))

    def test_oracle_is_vllm_032(self, run: Run) -> None:
        parity.assert_vllm_032(run.answers)

    def test_matches_vllm(self, run: Run, name: str) -> None:
        """Every chunking and the full answer against vLLM's (one test per case: both paths share the setup)."""
        failures = case_failures(self.family, run, name)
        assert not failures


def case_failures(family: Family, run: Run, name: str) -> dict[str, list[str]]:
    """What differs from vLLM on one case, once its deviations are reconciled, by path and chunking."""
    case, result, vocab = run.built.cases[name], run.answers[name], run.built.vocabs[name]
    deviations = family.deviations.get(name, ())
    counted = family.reasoning_tokens != "off" and name not in family.uncounted
    as_json, id_prefix = name not in family.raw_arguments, family.call_id is None
    failures: dict[str, list[str]] = {}

    ours = onehop_full(vocab, case)
    full = reconcile(ours, result["full"], "full", deviations, normal_calls=family.normal_calls)
    diffs = raw_reserialised(ours, full) if family.full_reserialises_raw and name in family.raw_arguments else []
    diffs += compare(
        ours,
        full,
        reasoning_tokens=counted,
        json_arguments=as_json,
        stop_reason=family.stop_reason,
        id_prefix=id_prefix,
    )
    diffs += id_errors(family, ours, "onehop") + id_errors(family, full, "vLLM")
    if diffs:
        failures["full"] = diffs

    lost: set[str] = set()
    seen: set[tuple[str, str]] = set()
    compared = parity.stream_check(
        deviations,
        lost=lost,
        seen=seen,
        normal_calls=family.normal_calls,
        reasoning_tokens=counted and family.reasoning_tokens == "compared",
        json_arguments=as_json,
        stop_reason=family.stop_reason,
        id_prefix=id_prefix,
    )

    def check(k: int, mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
        diffs = compared(k, mine, theirs) + id_errors(family, mine, "onehop") + id_errors(family, theirs, "vLLM")
        if isinstance(family.reasoning_tokens, Counted):
            diffs += counted_tokens(family.reasoning_tokens, name, k, mine, theirs, full["reasoning_tokens"])
        return diffs

    failures.update(parity.stream_failures(vocab, case, result, check, label="stream {k}: {sizes}"))
    stream = [d for d in deviations if d.path == "stream"]
    if family.lossy_must_bite and lost != (lossy := {d.name for d in stream if isinstance(d.vllm, Lossy)}):
        failures["lossy"] = [f"vLLM no longer loses text in {sorted(lossy - lost)}"]
    listed = {(d.name, repr(v)) for d in stream if not isinstance(d.vllm, Lossy) for v in d.vllm}
    if family.listed_values_must_occur and seen != listed:
        failures["listed"] = ["a listed vLLM value no longer occurs"]
    return failures


def counted_tokens(
    counted: Counted, name: str, k: int, mine: dict[str, Any], theirs: dict[str, Any], full: int | None
) -> list[str]:
    """Chunking `k`'s streamed `reasoning_tokens` against the count by ids (`full`) or the listed exception."""
    listed = counted.vllm_stream.get((name, k), counted.vllm_stream.get((name, None)))
    expected = listed if isinstance(listed, tuple) else (full if listed is None else listed, full)
    tokens = (theirs["reasoning_tokens"], mine["reasoning_tokens"])
    if counted.check_vllm and tokens != expected:
        return [f"reasoning_tokens (vLLM stream, onehop) = {tokens}, expected {expected}"]
    if not counted.check_vllm and tokens[1] != expected[1]:
        return [f"reasoning_tokens onehop {tokens[1]} != {expected[1]}"]
    return []


def id_errors(family: Family, answer: dict[str, Any], side: str) -> list[str]:
    """Call ids not of the family's shape (none when the family compares onehop's usual prefix)."""
    if family.call_id is None:
        return []
    ids = [c.get("id") or "" for c in answer.get("tool_calls") or []]
    return [f"{side} id {i!r} is not of the family's shape" for i in ids if not family.call_id(i)]


def raw_reserialised(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """vLLM's raw arguments set to onehop's text where both parse to the same value; what does not."""
    diffs = []
    for mine, other in zip(ours["tool_calls"], theirs["tool_calls"], strict=False):
        if parsed_json(mine["arguments"]) != parsed_json(other["arguments"]):
            diffs.append(f"arguments: onehop {mine['arguments']!r} != vLLM {other['arguments']!r}")
        other["arguments"] = mine["arguments"]
    return diffs


class TestDeepseek(ParityTests):
    family = deepseek.FAMILY


class TestGlm(ParityTests):
    family = glm.FAMILY


class TestHarmony(ParityTests):
    family = harmony.FAMILY

    def test_tokenizer_is_o200k_harmony(self, run: Run) -> None:
        ids = run.built.tokenizer.encode(
            "<|start|>assistant<|channel|>final<|message|>Hi<|return|><|call|>", add_special_tokens=False
        ).ids
        assert ids[0] == 200006 and ids[2] == 200005 and ids[4] == 200008
        assert ids[-2:] == [harmony.RETURN_ID, harmony.CALL_ID]


class TestKimiK2(ParityTests):
    family = kimi_k2.FAMILY


class TestLlama3Json(ParityTests):
    family = llama3_json.FAMILY


class TestMinimaxM2(ParityTests):
    family = minimax_m2.FAMILY


class TestMistral(ParityTests):
    family = mistral.FAMILY


class TestPythonic(ParityTests):
    family = pythonic.FAMILY


class TestQwen3Coder(ParityTests):
    family = qwen3_coder.FAMILY


class TestQwen3Hermes(ParityTests):
    family = qwen3_hermes.FAMILY
