"""The derender benchmark runs end to end and reports every column (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_derender", ROOT / "scripts" / "bench_derender.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_short_run_reports_all_columns(tmp_path: Path, capsys: object) -> None:
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--lengths", "120,200", "--repeats", "1", "--no-vllm", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [row["tokens"] for row in results["rows"]] == [120, 200]
    for row in results["rows"]:
        for column in ("a_parse_us", "a_serialize_us", "b_serialize_us"):
            assert row[column] > 0
        result = row["result"]
        assert [call["name"] for call in result["tool_calls"]] == ["get_weather", "get_time"]
        assert [json.loads(call["arguments"]) for call in result["tool_calls"]] == [
            {"city": "Paris", "unit": "celsius"},
            {"tz": "Europe/Paris"},
        ]
        assert result["content"] == "\n\nLet me check both."  # the newline before the call is dropped
        assert result["reasoning"].startswith("\n")
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "(b)/(a)" in printed and "per-token growth" in printed
