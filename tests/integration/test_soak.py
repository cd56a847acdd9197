"""The soak script runs end to end against real engine and gateway processes (a smoke run: no verdict, no timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole run of its own: CI's second stage
def test_short_soak_samples_both_processes(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--duration", "8", "--sample-every", "1", "--concurrency", "4", "--json", str(out)]
    command = [sys.executable, str(ROOT / "scripts" / "soak.py"), *args]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 2: unexpected errors
    results = json.loads(out.read_text())

    samples = results["samples"]
    assert len(samples) >= 3
    for s in samples:
        for proc in ("gateway", "engine"):
            assert s[proc]["rss_kb"] > 0 and s[proc]["fds"] > 0, (proc, s)
    assert samples[-1]["requests"] > 0 and results["requests"] >= samples[-1]["requests"]

    outcomes = results["outcomes"]
    assert outcomes.get("200", 0) > 0
    assert not [status for status in outcomes if status.isdigit() and int(status) >= 500], outcomes
    assert not [key for key in outcomes if key.startswith("exc:")], outcomes
    verdict = results["verdict"]
    assert verdict["unexpected"] == {}, verdict["unexpected_examples"]
    assert "flat" in verdict and verdict["line"].startswith("verdict: ")
