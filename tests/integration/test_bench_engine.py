"""The engine benchmark runs end to end against a real engine process (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "scripts" / "bench_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_short_run_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    assert load_bench().main(["--requests", "2", "--concurrency", "2", "--words", "40", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [row["mode"] for row in results["rows"]] == ["tokens", "text", "derender", "derender, top_logprobs=20"]
    for row in results["rows"]:
        assert row["output_tokens"] == 2 * results["tokens_per_request"]
        assert row["process_cpu_s_per_1k"] >= 0  # clock ticks: a short run may read zero
        assert row["output_cpu_s_per_1k"] > 0


def test_overhead_mode_compares_before_and_after_on_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert load_bench().main(["--overhead", "--rounds", "2", "--words", "40", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [row["mode"] for row in results["rows"]] == ["tokens", "text", "derender", "derender, top_logprobs=20"]
    for row in results["rows"]:
        assert row["tokens"] == results["tokens_per_request"] > 40
        assert row["work_us_per_token"] > 0
        assert row["metered_share"] > 0  # the after-run put its output CPU in the metric
