"""scripts/bench_apis.py --quick streams every API through one gateway and reports each cell
(no timings asserted: the numbers are for reading side by side, not for a bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


@pytest.mark.slow  # starts an engine and two gateways of its own: CI's second stage
def test_quick_run_reports_every_api_and_concurrency_beside_a_baseline(tmp_path: Path) -> None:
    out = tmp_path / "apis.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_apis.py"), "--quick", "--baseline", "HEAD", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    cells = {(row["tree"], row["api"], row["streams"]) for row in results["rows"]}
    assert cells == {
        (tree, api, streams) for tree in ("this", "HEAD") for api in ("chat", "responses", "messages") for streams in (1, 16)
    }
    for row in results["rows"]:
        assert row["requests"] == results["size"]["requests"] * results["size"]["rounds"]
        assert row["events_per_request"] >= results["size"]["tokens"] // 2  # streamed, not answered whole
        assert row["cpu_us_per_token"] >= 0
    assert "| messages | 16 |" in done.stdout
