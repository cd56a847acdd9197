"""The per-step histogram exposes what prometheus_client's Histogram would, for the same samples,
and the engine's step loop puts every gap in it."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine.backends.base import BackendOutput
from engine import generate
from engine.generate import _drive, _Times
from engine.metrics import _GAP_BUCKETS, EngineMetrics, StepHistogram
from wire.protocol import EngineSummary, GenerateRequest, SamplingParams

SAMPLES = [0.0, 1e-4, 3e-4, 1e-3, 0.0049, 0.02, 0.02, 0.7, 2.5, 9.0]


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if not line.startswith("#") and "_created" not in line)


def test_observed_one_by_one_or_merged_it_matches_prometheus() -> None:
    theirs, observed, merged = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    args = ("onehop_engine_inter_token_latency_seconds", "Gap", ["mode"])
    reference = Histogram(*args, buckets=_GAP_BUCKETS, registry=theirs)
    one_by_one = StepHistogram(*args, buckets=_GAP_BUCKETS, registry=observed)
    in_bulk = StepHistogram(*args, buckets=_GAP_BUCKETS, registry=merged)
    for value in SAMPLES:
        reference.labels("text").observe(value)
        one_by_one.labels("text").observe(value)
    # What the engine does: bucket counts in a local list, the sum once at the end.
    child = in_bulk.labels("text")
    counts = [0] * len(child.counts)
    scratch = StepHistogram("scratch", "", ["mode"], buckets=_GAP_BUCKETS, registry=CollectorRegistry()).labels("x")
    for value in SAMPLES:
        scratch.observe(value)
    counts[:] = scratch.counts
    child.merge(counts, sum(SAMPLES))
    expected = _lines(theirs)
    assert _lines(observed) == expected
    assert _lines(merged) == expected
    assert any('le="+Inf"' in line and line.endswith(f" {float(len(SAMPLES))}") for line in expected)


class _Writer:
    """One payload a step, one choice that stays open: only the step loop's bookkeeping is under test."""

    def head(self) -> list[bytes]:
        return []

    def step(self, output: Any) -> bytes:
        return b"{}"

    def open_choices(self) -> list[int]:
        return [0]

    def tail(self) -> list[bytes]:
        return []

    def summary(self) -> EngineSummary:
        return EngineSummary(finish_reasons=["length"], prompt_tokens=1, completion_tokens=STEPS)


STEPS = 200


async def test_the_step_loop_counts_every_gap_in_its_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of gaps in one bucket, changes of bucket, gaps on a bound (`le` is inclusive),
    on timed and untimed steps alike: the same histogram as observing each gap."""
    gaps = [_GAP_BUCKETS[(i // 7) % len(_GAP_BUCKETS)] * (1.0 if i % 3 else 0.5) for i in range(STEPS - 1)]
    gaps[50:60] = [30.0] * 10  # past the last bound: +Inf
    stamps = [100.0]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    clock = iter(stamps)
    # The step loop's clock only (the event loop keeps the real one).
    monkeypatch.setattr(generate, "time", SimpleNamespace(monotonic=lambda: next(clock), thread_time=time.thread_time))
    metrics = EngineMetrics()
    request = GenerateRequest(request_id="r", token_ids=[1], sampling_params=SamplingParams(max_tokens=STEPS), output_mode="tokens")
    steps = [[BackendOutput(index=0, token_ids=[1])] for _ in range(STEPS)]

    async def outputs() -> AsyncIterator[list[BackendOutput]]:
        for batch in steps:
            yield batch

    sent = [payload async for payload in _drive(metrics, request, _Writer(), outputs(), _Times(arrived=99.0))]  # type: ignore[arg-type]
    assert len(sent) == STEPS + 1  # and the abort of the choice the backend left open
    reference = Histogram("gap", "", buckets=_GAP_BUCKETS, registry=CollectorRegistry())
    for earlier, later in itertools.pairwise(stamps):
        reference.observe(later - earlier)
    expected = [bucket.get() for bucket in reference._buckets]
    assert metrics.inter_token_latency.labels("tokens").counts == expected
    assert metrics.inter_token_latency.labels("tokens").sum == pytest.approx(stamps[-1] - stamps[0])
