"""Known differences from vLLM, and the harness the parity tests share (`tests/vllm/test_parity.py`).

A parity test compares onehop's answer with vLLM's field by field
(`tests.support.vllm_oracle.compare`). Where the two differ on purpose, the
case carries a `Deviation`: both sides' exact values are asserted first (the
test fails if either side changes), and only then is vLLM's field set to
onehop's so the rest of the answer is still compared.

A family's case table (`tests/vllm/parity_cases/`) builds its cases with
`oracle_case`; the harness asks vLLM once per family with `oracle_answers` and
checks each case with `stream_failures` (every chunking) and with `reconcile`
and `compare` on the non-streamed answer.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from derender.vocab import TokenVocab
from tests.support.vllm_oracle import chunkings, compare, onehop_answer, run_oracle, vllm_python


VLLM_VERSION = "0.32.0"
NO_VLLM = "no vLLM venv: run scripts/setup_vllm.sh or set ONEHOP_VLLM_PYTHON"

Check = Callable[[int, dict[str, Any], dict[str, Any]], list[str]]
"""`check(k, ours, theirs)`: what differs on chunking `k` (onehop's answer, vLLM's)."""


@dataclass(frozen=True)
class Lossy:
    """vLLM's value is onehop's with characters (or whole calls' arguments) missing, on some chunkings.

    `of`: the value vLLM's loses characters of, where onehop's differs from it on purpose as well
    (the whitespace before a call, a cut call's closing: issue #27); None: onehop's own value.
    """

    of: Any = None


LOSSY = Lossy()


@dataclass(frozen=True)
class Deviation:
    """A known difference on one path: `field` reads one of `vllm` in vLLM's answer, `onehop` in onehop's.

    `field` is `content`, `reasoning`, `finish_reason`, `reasoning_tokens` or `calls`
    (the list of `(name, arguments)`); `vllm` lists every value vLLM gives over the
    chunkings, or is `LOSSY`.
    """

    name: str
    path: Literal["stream", "full"]
    field: str
    vllm: tuple[Any, ...] | Lossy
    onehop: Any


CLOSES_CUT_CALL = "onehop_closes_cut_call_to_json"
"""A call cut short (`max_tokens`, a stop string, EOS inside it) ends with one more arguments delta
that closes it to valid JSON, the same text non-streamed (issue #27); vLLM sends the raw prefix."""
DROPS_SPACE_BEFORE_CALL = "onehop_drops_space_before_call"
"""Whitespace right before a call is held and dropped in both shapes (issue #27); vLLM keeps it."""


def both(name: str, field: str, vllm: Any, onehop: Any) -> tuple[Deviation, Deviation]:
    """The same single-valued difference on the streamed and the non-streamed path."""
    return Deviation(name, "stream", field, (vllm,), onehop), Deviation(name, "full", field, (vllm,), onehop)


def project(answer: dict[str, Any], field: str) -> Any:
    """One field of an oracle-shaped answer, as a `Deviation` names it."""
    if field == "calls":
        return [(c["name"], c["arguments"]) for c in answer["tool_calls"]]
    if field in ("content", "reasoning"):
        return answer.get(field) or None
    return answer.get(field)


def is_lossy(theirs: Any, ours: Any) -> bool:
    """`theirs` is `ours` with characters (or whole calls' arguments) missing."""
    if isinstance(ours, list):
        return (
            isinstance(theirs, list)
            and len(theirs) == len(ours)
            and all(t[0] == o[0] and is_lossy(t[1], o[1]) for t, o in zip(theirs, ours, strict=True))
        )
    remaining = iter(ours or "")
    return all(char in remaining for char in theirs or "")


def parsed_calls(calls: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
    """Calls with JSON arguments parsed, for a family whose vLLM side re-serialises them."""
    return [(name, parsed_json(arguments)) for name, arguments in calls]


def parsed_json(arguments: str) -> Any:
    """JSON text parsed, or the text itself when it is not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def reconcile(
    ours: dict[str, Any],
    theirs: dict[str, Any],
    path: str,
    deviations: Sequence[Deviation],
    *,
    lost: set[str] | None = None,
    seen: set[tuple[str, str]] | None = None,
    normal_calls: Callable[[Sequence[tuple[str, str]]], Any] = list,
) -> dict[str, Any]:
    """vLLM's answer with each known deviation on `path` checked, then set to onehop's value.

    `lost` collects the names of `LOSSY` deviations that did lose text on this
    answer (a test can require each to have bitten on some chunking); `seen`
    collects `(name, repr(vLLM's value))`, so a test can require every listed
    value to occur on some chunking (a stale entry fails);
    `normal_calls` maps both sides' calls before vLLM's are compared with the
    listed values (`parsed_calls` when vLLM re-serialises JSON).
    """
    adjusted = copy.deepcopy(theirs)
    for deviation in (d for d in deviations if d.path == path):
        mine, other = project(ours, deviation.field), project(theirs, deviation.field)
        assert mine == deviation.onehop, f"{deviation.name}: onehop changed: {mine!r}"
        if seen is not None:
            seen.add((deviation.name, repr(other)))
        if isinstance(deviation.vllm, Lossy):
            whole = mine if deviation.vllm.of is None else deviation.vllm.of
            assert is_lossy(other, whole), f"{deviation.name}: vLLM changed: {other!r}"
            if other != whole and lost is not None:
                lost.add(deviation.name)
        elif deviation.field == "calls":
            listed = [normal_calls(value) for value in deviation.vllm]
            assert normal_calls(other) in listed, f"{deviation.name}: vLLM changed: {other!r}"
        else:
            assert other in deviation.vllm, f"{deviation.name}: vLLM changed: {other!r}"
        if deviation.field == "calls":
            adjusted["tool_calls"] = copy.deepcopy(ours["tool_calls"])
        else:
            adjusted[deviation.field] = ours.get(deviation.field)
    return adjusted


@dataclass(frozen=True)
class Split:
    """Output text whose marker spellings are encoded as ordinary tokens, not as the marker tokens."""

    text: str


def encode(tokenizer: Any, segments: Sequence[str | Split]) -> list[int]:
    """A case's output ids: each segment encoded on its own, so a marker segment is its token."""
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, Split):
            ids += tokenizer.encode(segment.text, add_special_tokens=False, split_special_tokens=True)
        else:
            ids += tokenizer.encode(segment, add_special_tokens=False)
    return ids


def encode_fast(tokenizer: Any, segments: Sequence[str | Split]) -> list[int]:
    """`encode` for a `tokenizers.Tokenizer`: a `Split` segment's marker spellings as ordinary tokens."""
    ids: list[int] = []
    for segment in segments:
        tokenizer.encode_special_tokens = isinstance(segment, Split)
        text = segment.text if isinstance(segment, Split) else segment
        try:
            ids += tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            tokenizer.encode_special_tokens = False
    return ids


def oracle_case(
    folder: Path,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    seed: int,
    *,
    tool_parser: str | None,
    tools: list[Any] | None,
    messages: list[dict[str, Any]],
    reasoning_parser: str | None = None,
    stop: Sequence[str] = (),
    **fields: Any,
) -> dict[str, Any]:
    """One oracle case (schema in `scripts/vllm_parse_oracle.py`), cut in the standard chunkings for `seed`.

    `tool_choice` is `auto` where tools are offered; `fields` add or replace keys
    (`model_type`, `request`, `chat_template_kwargs`, `chunkings`, ...).
    """
    output = list(output_ids)
    case = {
        "tokenizer": str(folder),
        "tool_parser": tool_parser,
        "reasoning_parser": reasoning_parser,
        "tools": tools,
        "tool_choice": "auto" if tools else None,
        "parallel_tool_calls": None,
        "prompt_token_ids": list(prompt_ids),
        "output_token_ids": output,
        "stop": list(stop),
        "chunkings": chunkings(len(output), seed),
        "messages": messages,
    }
    return {**case, **fields}


def oracle_answers(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """vLLM's answer for each case, by name (skips the test without a vLLM venv)."""
    if vllm_python() is None:
        pytest.skip(NO_VLLM)
    results = run_oracle(list(cases.values()))
    return dict(zip(cases, results, strict=True))


def assert_vllm_032(oracle: dict[str, dict[str, Any]]) -> None:
    """Every answer came from vLLM 0.32.0, and none is an error."""
    assert {result["vllm_version"] for result in oracle.values()} == {VLLM_VERSION}
    assert not [name for name, result in oracle.items() if "error" in result]


def stream_failures(
    vocab: TokenVocab, case: dict[str, Any], result: dict[str, Any], check: Check, *, label: str = "{k}: {sizes}"
) -> dict[str, list[str]]:
    """`check` on onehop's and vLLM's answer for every chunking of `case`; what failed, by chunking.

    A chunking is named by `label`, formatted with its index `k` and its first 12 `sizes`.
    """
    failures = {}
    for k, (sizes, theirs) in enumerate(zip(case["chunkings"], result["stream"], strict=True)):
        ours = onehop_answer(vocab, case, sizes)
        if diffs := check(k, ours, theirs):
            failures[label.format(k=k, sizes=sizes[:12])] = diffs
    return failures


def stream_check(
    deviations: Sequence[Deviation],
    *,
    lost: set[str] | None = None,
    seen: set[tuple[str, str]] | None = None,
    normal_calls: Callable[[Sequence[tuple[str, str]]], Any] = list,
    id_prefix: bool = True,
    reasoning_tokens: bool = False,
    stop_reason: bool = False,
    json_arguments: bool = True,
) -> Check:
    """The usual `Check`: vLLM's streamed answer reconciled with `deviations`, then compared with
    onehop's (the options are `compare`'s)."""

    def check(k: int, ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
        adjusted = reconcile(ours, theirs, "stream", deviations, lost=lost, seen=seen, normal_calls=normal_calls)
        return compare(
            ours,
            adjusted,
            id_prefix=id_prefix,
            reasoning_tokens=reasoning_tokens,
            stop_reason=stop_reason,
            json_arguments=json_arguments,
        )

    return check

