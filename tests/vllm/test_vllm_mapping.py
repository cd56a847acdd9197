"""The `vllm` backend's pure parts, without vLLM: config, import, logprob mapping.

Not marked `vllm`: these run in the default suite, in the project's venv
where vLLM is never installed. vLLM's logprob containers are stood in for by
plain objects of the same shape (`FlatLogprobs` lists, `dict[int, Logprob]`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
import pytest

from engine.backends.base import BackendError
from engine.backends.vllm import VLLMBackend, VLLMBackendConfig, _top_count, logprob_entries
from wire.protocol import GenerateLogProb, GenerateLogProbsContent


@dataclass
class Flat:
    """The fields of vLLM's `FlatLogprobs` that the backend reads."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def position(self, entries: list[tuple[int, float, int | None]]) -> Flat:
        self.start_indices.append(len(self.token_ids))
        for token_id, logprob, rank in entries:
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
        self.end_indices.append(len(self.token_ids))
        return self


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


def as_dicts(flat: Flat) -> list[dict[int, Logprob]]:
    """vLLM's non-flat form: a dict per position, so a repeated sampled token collapses."""
    return [
        {flat.token_ids[i]: Logprob(flat.logprobs[i], flat.ranks[i]) for i in range(start, end)}
        for start, end in zip(flat.start_indices, flat.end_indices, strict=True)
    ]


def lp(token_id: int, logprob: float, rank: int | None) -> GenerateLogProb:
    return GenerateLogProb(token_id=token_id, logprob=logprob, rank=rank)


def test_module_imports_without_vllm() -> None:
    backend = VLLMBackend(VLLMBackendConfig(model="some/model"))
    assert backend.running() == frozenset()
    with pytest.raises(BackendError):
        _ = backend.info


def test_config_is_strict_and_maps_to_engine_args() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_model_length"):
        msgspec.convert({"model": "m", "max_model_length": 10}, VLLMBackendConfig)
    config = msgspec.convert(
        {"model": "m", "max_model_len": 2048, "extra_engine_args": {"max_num_seqs": 4}}, VLLMBackendConfig
    )
    args = config.engine_args()
    assert args["model"] == "m" and args["max_model_len"] == 2048 and args["max_num_seqs"] == 4
    assert args["enforce_eager"] is True and "served_model_name" not in args


@pytest.mark.parametrize(("logprobs", "count"), [(None, None), (0, 1), (1, 1), (3, 3), (-1, -1)])
def test_top_count_is_vllms(logprobs: int | None, count: int | None) -> None:
    assert _top_count(logprobs) == count


def test_sampled_in_top_k_appears_once() -> None:
    # Greedy: the sampled token is rank 1 and vLLM lists it twice in the flat form.
    flat = Flat().position([(7, -0.5, 1), (7, -0.5, 1), (9, -1.5, 2)])
    expected = [
        GenerateLogProbsContent(token_id=7, logprob=-0.5, rank=1, top_logprobs=[lp(7, -0.5, 1), lp(9, -1.5, 2)])
    ]
    assert logprob_entries(flat, [7], 2) == expected
    assert logprob_entries(as_dicts(flat), [7], 2) == expected


def test_sampled_outside_top_k_leads_and_the_list_is_cut_to_k() -> None:
    flat = Flat().position([(5, -4.0, 30), (7, -0.5, 1), (9, -1.5, 2)])
    expected = [
        GenerateLogProbsContent(token_id=5, logprob=-4.0, rank=30, top_logprobs=[lp(5, -4.0, 30), lp(7, -0.5, 1)])
    ]
    assert logprob_entries(flat, [5], 2) == expected
    assert logprob_entries(as_dicts(flat), [5], 2) == expected


def test_all_candidates_for_minus_one_and_one_entry_per_token() -> None:
    flat = Flat().position([(5, -4.0, 3), (7, -0.5, 1), (9, -1.5, 2), (5, -4.0, 3)])
    flat.position([(9, -0.1, 1), (9, -0.1, 1), (7, -2.5, 2), (5, -3.0, 3)])
    entries = logprob_entries(flat, [5, 9], -1)
    assert [[c.token_id for c in e.top_logprobs] for e in entries] == [[5, 7, 9], [9, 7, 5]]
    assert logprob_entries(as_dicts(flat), [5, 9], -1) == entries


def test_non_finite_logprobs_are_floored_and_rank_zero_is_no_rank() -> None:
    flat = Flat().position([(5, math.nan, 0), (7, -math.inf, 1)])
    (entry,) = logprob_entries(flat, [5], 2)
    assert entry == GenerateLogProbsContent(
        token_id=5, logprob=-9999.0, rank=None, top_logprobs=[lp(5, -9999.0, None), lp(7, -9999.0, 1)]
    )


def test_missing_logprobs_give_the_floor_sentinel() -> None:
    assert logprob_entries(None, [3, 4], 2) == [
        GenerateLogProbsContent(token_id=3, logprob=-9999.0),
        GenerateLogProbsContent(token_id=4, logprob=-9999.0),
    ]
