"""scripts/bench.py --quick runs every setup × workload end to end on the sim engine (no timings asserted)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench.py"
TIMEOUT_S = 120


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_harness", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a whole run of its own: CI's second stage
def test_quick_run_reports_every_setup_and_workload(tmp_path: Path) -> None:
    bench = load_bench()
    out_json, out_md = tmp_path / "out.json", tmp_path / "out.md"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out_json), "--markdown", str(out_md)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out_json.read_text())

    assert results["engine_note"] == "vLLM venv absent or not requested: sim engine"
    assert list(results["metrics"]) == list(bench.METRICS)
    cells = {(row["setup"], row["workload"]): row for row in results["rows"]}
    expected = {(setup, workload) for setup in bench.SETUPS for workload in bench.WORKLOADS}
    assert set(cells) == expected and len(results["rows"]) == len(expected)

    for (setup, workload), row in cells.items():
        where = f"{setup}/{workload}"
        for metric in bench.METRICS:
            assert metric in row, (where, metric)
            assert isinstance(row[metric], int | float) and math.isfinite(row[metric]), (where, metric, row[metric])
        assert row["requests"] == bench.QUICK_PLAN.requests[workload], where
        assert row["output_tokens"] > 0 and row["tokens_per_s"] > 0, where
        for name in bench.LATENCIES:
            p50, p90, p99 = (row[f"{name}_p{q}_ms"] for q in bench.PERCENTILES)
            assert 0 <= p50 <= p90 <= p99, (where, name, p50, p90, p99)
        assert row["ttft_p50_ms"] > 0 and row["e2e_p50_ms"] >= row["ttft_p50_ms"], where
        for tier in bench.TIERS:
            assert row[f"{tier}_cpu_s_per_1k_tokens"] >= 0, (where, tier)  # clock ticks: a short cell may read 0
        assert row["engine_output_cores"] >= 0, where
        if bench.WORKLOADS[workload].exact:
            assert row["output_tokens"] == row["requests"] * bench.QUICK_PLAN.max_tokens(bench.WORKLOADS[workload]), (
                where
            )
        if workload == "tools":
            assert row["tool_call_streams"] == row["requests"], where
        assert sum(row["routes"].values()) == row["requests"], where

    # The routes each setup stands for: C derender, D tokens, E by the policy (wide logprobs → tokens).
    assert {route for (s, _), row in cells.items() if s == "C" for route in row["routes"]} == {"derender"}
    assert {route for (s, _), row in cells.items() if s == "D" for route in row["routes"]} == {"tokens"}
    assert set(cells[("E", "logprobs")]["routes"]) == {"tokens"}
    assert any(line.startswith("D gateway CPU per 1k output tokens vs C") for line in results["ratio_lines"])
    assert any("engine_budget_cores" in line for line in results["ratio_lines"])

    report = out_md.read_text()
    header = next(line for line in report.splitlines() if line.startswith("| setup | workload |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["setup", "workload", *(bench.HEADERS[m] for m in bench.METRICS), "routes"]
    assert report in done.stdout
    for setup, workload in expected:
        assert f"| {setup} | {workload} |" in report


def test_unknown_setups_and_vllm_setups_without_vllm_are_refused(tmp_path: Path) -> None:
    no_vllm = str(tmp_path / "no-vllm" / "python")  # A and B need vLLM's python: refused without one
    for setups, message in (("A", "need vLLM's python"), ("C,B", "need vLLM's python"), ("C,Z", "unknown setup 'Z'")):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--quick", "--setups", setups, "--vllm-python", no_vllm],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0 and message in done.stderr, (setups, done.stderr[-1000:])
        assert "available: C,D,E" in done.stderr


def test_rounds_split_the_measured_prompts_evenly_after_the_warmup() -> None:
    bench = load_bench()
    assert bench.rounds(2, 12, 2) == [(2, 7), (7, 12)]
    assert bench.rounds(0, 7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert bench.rounds(1, 3, 5) == [(1, 2), (2, 3)]  # never an empty round
    spans = bench.rounds(8, 1032, 4)
    assert spans[0][0] == 8 and spans[-1][1] == 1032
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_requests_per_workload_are_parsed_strictly() -> None:
    bench = load_bench()
    default = dict(bench.FULL.requests)
    assert bench.parse_requests("5", default) == dict.fromkeys(default, 5)
    assert bench.parse_requests("reasoning=8,short=64", default) == {**default, "reasoning": 8, "short": 64}
    for text, message in (("reasonin=8", "unknown workload 'reasonin'"), ("short=0", "not a count"), ("short=x", "not a count")):
        with pytest.raises(ValueError, match=message):
            bench.parse_requests(text, default)


def test_reasoning_prompts_cycle_through_one_to_four_thousand_tokens() -> None:
    bench = load_bench()
    reasoning = bench.WORKLOADS["reasoning"]
    chosen = bench.prompts(reasoning, bench.FULL, 8)
    assert [p.max_tokens for p in chosen] == [1000, 2000, 3000, 4000] * 2
    assert all(json.loads(p.body)["max_tokens"] == p.max_tokens for p in chosen)
    assert bench.prompts(reasoning, bench.FULL, 8) == chosen  # seeded: every setup gets the same bodies
    assert {p.max_tokens for p in bench.prompts(reasoning, bench.QUICK_PLAN, 4)} == {200}
