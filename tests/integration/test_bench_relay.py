"""The relay and workers benchmarks run end to end against real processes (no timings asserted).

The Rust routers are left out here (`--no-routers`: no install in the default suite);
the onehop setups, the scripted upstream and the direct streams run for real.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a whole run of its own: CI's second stage
def test_quick_relay_run_reports_every_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_relay")
    out = tmp_path / "relay.json"
    assert bench.main(["--quick", "--no-routers", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    onehop = [f"onehop {r}: {p}" for r in bench.ONEHOP_ROUTES for p in bench.PRODUCERS.values()]
    setups = ["direct-upstream", "direct-engine", *bench.FLOORS, *onehop]
    assert sorted((r["setup"], r["streams"]) for r in rows) == sorted((s, n) for s in setups for n in bench.CONCURRENCY)
    for row in rows:
        assert row["requests"] == bench.QUICK.requests[row["streams"]] and row["events"] > 0
        assert math.isfinite(row["e2e_p50_ms"]) and row["e2e_p50_ms"] > 0
        if not row["setup"].startswith("direct"):
            assert row["cpu_us_per_chunk"] >= 0 and row["rss_mb"] > 0  # /proc counts clock ticks: may read zero
            assert math.isfinite(row["ttft_added_ms"])
        if row["setup"].startswith("onehop"):  # measured against the pump in front of the same producer
            assert math.isfinite(row["over_floor_us"])
    assert "targets: not checked" in capsys.readouterr().out


@pytest.mark.slow  # a whole run of its own: CI's second stage
def test_quick_workers_run_compares_one_and_two(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_workers")
    assert bench.main(["--quick", "--routes", "derender"]) == 0
    table = capsys.readouterr().out
    assert "| derender | 1 |" in table and "| derender | 2 |" in table
