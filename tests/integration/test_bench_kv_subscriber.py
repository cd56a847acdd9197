"""scripts/bench_kv_subscriber.py, a short run: the publisher fills its cache, the subscribed
gateway's index follows it, and each window's row counts what was sent (no timings asserted:
the CPU figures are for reading side by side, not for a bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
SIZE = 2000
BATCHES = 40


@pytest.mark.slow  # starts a publisher and two gateways of its own: CI's second stage
def test_a_short_run_reports_a_row_per_size_that_counts_what_was_sent(tmp_path: Path) -> None:
    out = tmp_path / "subscriber.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kv_subscriber.py"), "--sizes", str(SIZE),
         "--batches", str(BATCHES), "--rate", "200", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    [row] = results["rows"]
    assert row["size"] == SIZE and row["tree"] == "this" and row["batches"] == BATCHES
    assert row["stored_blocks"] >= 50 * BATCHES and row["removed_blocks"] > 0  # past the fill, each store evicts
    assert row["index_blocks"] == SIZE  # the index holds what the engine holds
    assert row["events_cpu_s"] >= 0 and row["silent_cpu_s"] >= 0
    assert "| µs / stored block |" in done.stdout
