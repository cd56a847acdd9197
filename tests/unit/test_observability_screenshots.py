"""The pictures of docs/observability.md were taken with the dashboard as it is now."""

from __future__ import annotations

from scripts.observability_screenshots import GRAPHS, IMAGES, PHOENIX_PNG, STAMP, dashboard_digest, stamp_line

REGENERATE = "run `PYTHONPATH=. .venv/bin/python scripts/observability_screenshots.py` (needs prometheus, chromium and scripts/setup_phoenix.sh)"


def test_the_screenshots_were_taken_with_this_dashboard() -> None:
    assert STAMP.is_file(), f"{STAMP} is missing: {REGENERATE}"
    assert STAMP.read_text() == stamp_line(dashboard_digest()), (
        f"configs/grafana/onehop-dashboard.json changed since docs/images/observability/ was made: {REGENERATE}"
    )


def test_every_screenshot_is_there() -> None:
    missing = [name for name in (*GRAPHS, PHOENIX_PNG) if not (IMAGES / name).is_file()]
    assert not missing, f"missing in {IMAGES}: {missing}: {REGENERATE}"
