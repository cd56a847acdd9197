"""The shipped Grafana dashboard and Prometheus example only use metrics onehop exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics
from gateway.config import EngineEndpoint, GatewayConfig
from gateway.observe.metrics import GatewayMetrics
from onehop.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "configs" / "grafana" / "onehop-dashboard.json"
PROMETHEUS = ROOT / "configs" / "prometheus.yml"
METRIC_NAME = re.compile(r"onehop_[a-z_]+")

# The sample names each family type exports (prometheus_client strips `_total`
# from a counter's family name).
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exported_names() -> set[str]:
    """Every sample name the gateway and engine can export.

    A fresh registry has no samples for labelled metrics, so names come from
    the families: a family name plus the suffixes its type exports.
    """
    names: set[str] = set()
    for text in (GatewayMetrics().render(), EngineMetrics().render()):
        for family in text_string_to_metric_families(text.decode()):
            names.add(family.name)
            names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
    return names


def unknown_metrics(exprs: Iterable[str], known: set[str]) -> set[str]:
    """The onehop metric names the expressions reference that are not exported."""
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)} - known


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _exprs() -> list[str]:
    return [t["expr"] for panel in _panels(_dashboard()["panels"]) for t in panel.get("targets", [])]


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = _dashboard()
    panels = list(_panels(dashboard["panels"]))
    assert len(panels) >= 10
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['title']!r} has no target"
        for target in targets:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r} has an empty expr"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_only_references_exported_metrics() -> None:
    exprs = _exprs()
    referenced = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert len(referenced) >= 10
    assert unknown_metrics(exprs, exported_names()) == set()


def test_every_exported_family_is_on_the_dashboard() -> None:
    exprs = _exprs()
    referenced = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    for metrics in (GatewayMetrics(), EngineMetrics()):
        # The registry's own families: no separate `_created` gauges.
        for family in metrics.registry.collect():
            samples = {family.name + suffix for suffix in _SUFFIXES[family.type]}
            assert samples & referenced, f"{family.name} has no panel"


def test_checker_reports_a_made_up_metric() -> None:
    known = exported_names()
    assert "onehop_gateway_requests_total" in known
    assert "onehop_gateway_requests" in known and "onehop_gateway_stage_seconds_bucket" in known
    assert unknown_metrics(["rate(onehop_gateway_nope_total[1m])"], known) == {"onehop_gateway_nope_total"}
    # A histogram has no `_total`, a counter no `_bucket`.
    assert unknown_metrics(
        ["onehop_gateway_stage_seconds_total", "onehop_engine_output_tokens_bucket"], known
    ) == {"onehop_gateway_stage_seconds_total", "onehop_engine_output_tokens_bucket"}


def test_prometheus_example_scrapes_the_defaults_every_five_seconds() -> None:
    """Its targets are where `onehop serve`, `onehop gateway` and `onehop engine` listen by default,
    so it works unedited for the one-command start and the two-process setup."""
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) >= {"onehop-gateway", "onehop-engine"}
    parser = build_parser()
    serve, engine = parser.parse_args(["serve"]), parser.parse_args(["engine", "--model", "unused"])
    gateway = GatewayConfig(model="m", tokenizer="unused", engines=[EngineEndpoint(url="http://127.0.0.1:9")])
    for name, targets in (
        ("onehop-gateway", {f"{serve.host}:{serve.port}", f"{gateway.host}:{gateway.port}"}),
        ("onehop-engine", {f"{engine.host}:{engine.port}"}),
    ):
        assert jobs[name]["metrics_path"] == "/metrics"
        assert targets <= set(jobs[name]["static_configs"][0]["targets"])


def test_panels_without_series_show_zero() -> None:
    """Grafana's "No data" reads as broken; a quiet gateway shows 0. The stats, one series each,
    also answer 0 through Prometheus' API (`or vector(0)`)."""
    for panel in _panels(_dashboard()["panels"]):
        assert panel["fieldConfig"]["defaults"]["noValue"] == "0", panel["title"]
        if panel["type"] == "stat":
            for target in panel["targets"]:
                assert target["expr"].endswith(" or vector(0)"), panel["title"]


def test_stream_errors_are_in_the_5xx_ratio_and_on_a_panel() -> None:
    """A stream that broke after its 200 headers counts under its error's status (so in the 5xx
    ratio) and in `onehop_gateway_stream_errors_total`, which has its own series."""
    exprs = _exprs()
    assert any('status=~"5.."' in expr for expr in exprs)
    assert any("sum by (endpoint, route, error) (rate(onehop_gateway_stream_errors_total" in expr for expr in exprs)
    assert any("sum by (endpoint, route, kind) (rate(onehop_gateway_tokens_total" in expr for expr in exprs)
