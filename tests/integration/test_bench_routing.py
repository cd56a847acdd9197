"""scripts/bench_routing.py --quick runs every workload through every balancing mode and reports
a row for each, beside the oracle's (no timings asserted: the numbers are for reading side by
side, not for a bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
WORKLOADS = {"agentic", "mixed", "no_reuse"}
MODES = {"least_outstanding", "prefix_affinity", "kv_cache", "kv_cache+session"}
TOLERANCE = 0.02
"""A mode may beat the oracle by a little: the oracle counts a concurrent request's blocks as
held only after the earlier one in the workload's order, whichever finished first."""
FLOOR_SLACK = 1.15
"""The TTFT floor's fixed part is a median of requests sent alone: a mode's p50 may dip below it by noise."""


@pytest.mark.slow  # starts four engines and four gateways of its own: CI's second stage
def test_quick_run_reports_every_workload_and_mode_under_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_routing.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["workloads"]) == WORKLOADS
    for name, workload in results["workloads"].items():
        rows = {row["mode"]: row for row in workload["rows"]}
        assert set(rows) == MODES | {"oracle"}, name
        oracle = rows["oracle"]["hit_rate"]
        assert oracle == workload["oracle"]["hit_rate"]
        for mode in MODES:
            row = rows[mode]
            assert row["requests"] == workload["requests"] * results["size"]["rounds"], (name, mode)
            assert 0 <= row["hit_rate"] <= 1, (name, mode)
            assert row["hit_rate"] <= oracle + TOLERANCE, (name, mode, row["hit_rate"], oracle)
            assert row["prompt_length_mismatches"] == 0, (name, mode)  # the oracle renders as the gateway does
            assert row["ttft_p50_ms"] <= row["e2e_p50_ms"] and row["throughput_rps"] > 0, (name, mode)
            # the floor is no routing's TTFT: below every mode's (bar noise in its measured fixed part)
            assert rows["oracle"]["ttft_p50_ms"] <= row["ttft_p50_ms"] * FLOOR_SLACK, (name, mode)
        assert workload["floor"]["fixed_ms"] > 0 and workload["floor"]["sampled"] > 0, name
    assert results["workloads"]["no_reuse"]["oracle"]["hit_rate"] == 0
    assert results["workloads"]["agentic"]["oracle"]["hit_rate"] > 0.5  # its sessions share and extend prefixes
    subscriber = results["subscriber"]
    assert subscriber["recorded"]["blocks_stored"] > 0 and subscriber["recorded"]["apply_us_per_stored_block"] > 0
    assert subscriber["index_memory"]["bytes_per_block"] > 0
    assert {target["name"] for target in results["targets"]} >= {
        "agentic: kv_cache hit rate / oracle", "agentic: least_outstanding TTFT p50 / kv_cache TTFT p50",
        "no_reuse: kv_cache throughput / least_outstanding throughput",
    }
    assert "| kv_cache+session |" in done.stdout and "| oracle |" in done.stdout
