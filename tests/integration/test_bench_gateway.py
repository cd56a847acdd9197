"""The gateway benchmark runs end to end against real engine and gateway processes (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]

LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "e2e_p50_ratio")


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gateway", ROOT / "scripts" / "bench_gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_every_cell(tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "gateway.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [(r["route"], r["concurrency"]) for r in rows] == [
        (target, streams) for streams in bench.CONCURRENCY for target in bench.TARGETS
    ]
    for row in rows:
        assert row["requests"] == bench.QUICK.requests[row["concurrency"]]
        assert row["events"] > 0
        for column in LATENCIES:
            assert math.isfinite(row[column]) and row[column] > 0, (row["route"], row["concurrency"], column)
        assert math.isfinite(row["added_ttft_p50_ms"])  # a difference: either sign
        cpu = row["gateway_cpu_ms_per_1k_chunks"]
        if row["route"] == bench.DIRECT:
            assert cpu is None
        else:
            assert math.isfinite(cpu) and cpu >= 0  # /proc counts clock ticks: a short cell may read zero
    for cell in results["cells"]:
        assert len(cell["ttft_s"]) == len(cell["e2e_s"]) == cell["requests"]
