"""The gateway benchmark runs end to end against real engine and gateway processes (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "e2e_p50_ratio")


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gateway", ROOT / "scripts" / "bench_gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a whole run of its own: CI's second stage
def test_quick_run_reports_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    out = tmp_path / "gateway.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
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

    # Tracing off and at 100% sampling, side by side: the spans really reached the OTLP sink.
    tracing = results["tracing"]
    plan = bench.QUICK
    assert tracing["route"] == "derender" and tracing["concurrency"] == plan.tracing_streams
    per_cell = plan.tracing_requests + plan.warmup * plan.tracing_streams
    assert tracing["requests_per_gateway"] == plan.tracing_rounds * per_cell
    assert tracing["traced_requests"] == (plan.tracing_rounds + 1) * per_cell  # with the warm-up round
    assert len(tracing["round_ratios"]) == plan.tracing_rounds
    for key in ("off_cpu_ms_per_request", "on_cpu_ms_per_request", "cpu_ratio"):
        assert math.isfinite(tracing[key]) and tracing[key] > 0, key
    assert tracing["ratio_min"] <= tracing["cpu_ratio"] <= tracing["ratio_max"]
    # Each traced request: the server span, render, policy and engine.generate (gateway spans only).
    assert tracing["spans_per_request"] >= 4
    names = tracing["span_names_per_request"]
    for name in ("chat sim", "render", "policy", "engine.generate"):
        assert names.get(name, 0) >= 1, (name, names)
    assert tracing["exports"] >= 1
    line = next(line for line in printed.splitlines() if line.startswith("tracing at 100% sampling: gateway CPU/request ×"))
    assert "spans/request exported" in line and "target <= 1.05" in line
