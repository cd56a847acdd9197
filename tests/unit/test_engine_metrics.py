"""The per-step histogram exposes what prometheus_client's Histogram would, for the same samples."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine.metrics import _GAP_BUCKETS, StepHistogram

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
