"""The shipped Grafana dashboard's queries, as Prometheus' own API takes them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "onehop-dashboard.json"
RANGE = "1m"
"""What Grafana's range variables stand for here: a window over the whole of a test's traffic."""
_RANGES = {"__rate_interval", "__interval", "__range"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str
    """As Prometheus takes it: Grafana's variables substituted."""
    no_value: str | None = None
    """What the panel shows while its queries return no series (`noValue`; None: "No data")."""


def for_prometheus(expr: str, rate_range: str = RANGE) -> str:
    """`$__rate_interval` and the other range variables become `rate_range`; a template variable
    (`$model` in `model=~"$model"`) becomes `.*`, as Grafana's "All" does."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return rate_range if name in _RANGES else ".*"

    return _VARIABLE.sub(value, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a row's collapsed panels


def dashboard_queries(path: Path = DASHBOARD, *, rate_range: str = RANGE) -> list[Query]:
    """Every target's `expr` of every panel (rows' panels included), in the file's order."""
    board = json.loads(path.read_text())
    return [
        Query(
            panel.get("title", ""),
            for_prometheus(target["expr"], rate_range),
            panel.get("fieldConfig", {}).get("defaults", {}).get("noValue"),
        )
        for panel in _panels(board["panels"])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
