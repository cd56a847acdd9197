"""What a model family brings to the vLLM parity run: its cases, how they are encoded, what differs on purpose.

`tests/vllm/test_parity.py` runs every family the same way: it builds the
family's oracle cases, asks vLLM for its answers once per family, and compares
onehop's answer with vLLM's on every chunking and non-streamed. A family module
(`tests/vllm/parity_cases/<family>.py`) holds only what is its own: the model
output of each case, the request around it, the named `Deviation`s, and the
few ways its answers are compared (a `Family`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from derender.vocab import TokenVocab
from tests.support.parity import Deviation

Fixture = Callable[[str], Any]
"""A pytest fixture's value by name (`request.getfixturevalue`): the shared tokenizers."""
SpecT = TypeVar("SpecT")


@dataclass(frozen=True)
class Built:
    """A family's oracle cases and the decode tables onehop reads them with, by case name."""

    cases: dict[str, dict[str, Any]]
    vocabs: dict[str, TokenVocab]
    tokenizer: Any
    """The family's tokenizer (a family's own checks of it)."""


def build_all(
    specs: Mapping[str, SpecT],
    case: Callable[[SpecT, int], dict[str, Any]],
    vocab: Callable[[SpecT], TokenVocab],
    tokenizer: Any,
) -> Built:
    """Every spec's oracle case, seeded by its position (the seed picks its random chunkings)."""
    cases = {name: case(spec, seed) for seed, (name, spec) in enumerate(specs.items())}
    return Built(cases, {name: vocab(spec) for name, spec in specs.items()}, tokenizer)


StreamTokens = Mapping[tuple[str, int | None], int | tuple[int, int]]
"""(case, chunking index, or None for every chunking) -> vLLM's streamed `reasoning_tokens`,
or (vLLM's, onehop's) where onehop's is written out too."""


@dataclass(frozen=True)
class Counted:
    """`reasoning_tokens` counted by ids: onehop's streamed count is its non-streamed one on every chunking.

    onehop's non-streamed count is vLLM's once the full path's deviations are
    applied; vLLM's streamed count is that too, except where `vllm_stream` says
    (its stream counts what its text shows, which can lag the ids). With
    `check_vllm` False, vLLM's streamed count is not asserted at all.
    """

    vllm_stream: StreamTokens = field(default_factory=dict)
    check_vllm: bool = True


@dataclass(frozen=True)
class Family:
    """One family's parity cases and how its answers are compared with vLLM's."""

    name: str
    build: Callable[[Fixture], Built]
    """The oracle cases, from the shared tokenizer fixtures (called once vLLM is known to be there)."""
    cases: Sequence[str]
    deviations: Mapping[str, tuple[Deviation, ...]]
    """Each case's known differences from vLLM, both sides' values asserted (none: the case agrees)."""
    raw_arguments: frozenset[str] = frozenset()
    """Cases whose call arguments are not JSON on either side: compared as text."""
    reasoning_tokens: Literal["off", "compared"] | Counted = "off"
    """`off`: not compared; `compared`: like any field, stream and full; `Counted`: see there."""
    uncounted: frozenset[str] = frozenset()
    """Cases whose `reasoning_tokens` is not compared (no reasoning parser: vLLM reports none on the wire)."""
    stop_reason: bool = False
    normal_calls: Callable[[Sequence[tuple[str, str]]], Any] = list
    """How both sides' calls are mapped before vLLM's are matched with a deviation's (`parsed_calls`
    where vLLM re-serialises JSON)."""
    call_id: Callable[[str], bool] | None = None
    """The shape every call id must have on both sides; None: onehop's usual id prefix, compared."""
    lossy_must_bite: bool = False
    """Every `Lossy` stream deviation must lose text on some chunking (a stale one fails)."""
    listed_values_must_occur: bool = False
    """Every vLLM value a stream deviation lists must occur on some chunking (a stale one fails)."""
    full_reserialises_raw: bool = False
    """vLLM's full answer gives raw (non-JSON) arguments back re-serialised where they parse:
    raw arguments match when they parse to the same value."""
