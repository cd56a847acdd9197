"""The screenshots of docs/observability.md, taken from real tools: a gateway and a sim engine
serve a minute of mixed traffic (every API, streamed and whole, every route, refusals) while a
real Prometheus scrapes them and Arize Phoenix receives their spans; then headless Chromium
photographs Prometheus' graph of two of the dashboard's queries (tokens/s by kind, requests/s by
route) and Phoenix's view of one request's trace.

    PYTHONPATH=. .venv/bin/python scripts/observability_screenshots.py [--seconds 60]

Needs `prometheus` and `chromium` (apt-get install prometheus chromium) and Phoenix's venv
(bash scripts/setup_phoenix.sh). Writes docs/images/observability/*.png and `dashboard.sha256`,
the digest of configs/grafana/onehop-dashboard.json they were taken with: a unit test
(tests/unit/test_observability_screenshots.py) fails when the dashboard changes until this
script runs again.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from urllib.parse import urlencode

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub

from engine.qwen3.fixtures import ensure_tokenizer
from gateway.config import EngineEndpoint, GatewayConfig
from plumbing.telemetry import TracingConfig
from tests.support import phoenix_server as phoenix_support
from tests.support import prometheus_server as prometheus_support
from tests.support.dashboard import DASHBOARD, dashboard_queries
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.observed_traffic import MODEL, ROUTES, SHARED_PREFIX, Traffic
from tests.support.phoenix_server import Phoenix, phoenix_server
from tests.support.prometheus_server import Prometheus, prometheus_server

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images" / "observability"
STAMP = IMAGES / "dashboard.sha256"
GRAPHS = {
    "prometheus-tokens.png": "onehop_gateway_tokens_total",
    "prometheus-requests.png": "sum by (route) (rate(onehop_gateway_requests_total",
}
"""Each Prometheus picture: the dashboard query it shows (the first whose text holds this)."""
PHOENIX_PNG = "phoenix-trace.png"
RATE_RANGE = "15s"
"""The graphs' rate window: the run lasts a minute, Grafana's $__rate_interval would flatten it."""
CHROMIUM_BUDGET_MS = 15_000
"""Virtual time Chromium gives a page's scripts to fetch and draw before the picture."""


def dashboard_digest(path: Path = DASHBOARD) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stamp_line(digest: str) -> str:
    """`sha256sum`'s format, so `sha256sum -c` can check it from the repository's root."""
    return f"{digest}  {DASHBOARD.relative_to(ROOT)}\n"


async def one_round(traffic: Traffic, round_number: int) -> None:
    """A mix like an agent fleet's: every API and route, streams and not, tools, a cached prefix, a 400."""
    route = ROUTES[round_number % len(ROUTES)]
    await traffic.chat("user", route, stream=True)
    await traffic.chat("user", route, stream=False, tools=True)
    await traffic.chat("user", "tokens", stream=False, system=SHARED_PREFIX)
    await traffic.completion("user", route, stream=round_number % 2 == 0)
    await traffic.response("user", "derender", stream=True)
    await traffic.message("user", "derender", stream=round_number % 2 == 1)
    if round_number % 5 == 0:
        await traffic.bad_chat("user")


def graph_url(prometheus: Prometheus, expr: str, seconds: float) -> str:
    """Prometheus' graph of `expr` over the run (and a little before it)."""
    query = {"g0.expr": expr, "g0.tab": "0", "g0.stacked": "0", "g0.range_input": f"{int(seconds) + 20}s"}
    return f"{prometheus.url}/classic/graph?{urlencode(query)}"  # Debian's package serves the classic UI


def screenshot(chromium: str, url: str, out: Path, size: tuple[int, int]) -> None:
    args = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={size[0]},{size[1]}",
        "--force-prefers-reduced-motion",  # else Phoenix's trace drawer is caught sliding in, half see-through
        f"--virtual-time-budget={CHROMIUM_BUDGET_MS}", f"--screenshot={out}", url,
    ]  # fmt: skip
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    if not out.is_file() or out.stat().st_size < 10_000:
        raise SystemExit(f"chromium wrote no picture of {url} to {out}")
    print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes) from {url}")


async def shown_trace(phoenix: Phoenix, trace_header: str | None) -> str:
    """The trace to photograph: the one the answer's `traceresponse` names, stored with the
    engine's span (Phoenix inserts in the background)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = await phoenix.spans()
        engine_traces = [s.trace_id for s in spans if s.name == "POST /inference/v1/generate"]
        wanted = trace_header.split("-")[1] if trace_header else (engine_traces[-1] if engine_traces else None)
        if wanted is not None and wanted in engine_traces:
            return wanted
        await asyncio.sleep(0.5)  # polling its API: it says nothing when it stored a batch
    raise SystemExit("Phoenix never stored the trace to show")


async def run(seconds: float, chromium: str) -> None:
    tokenizer = ensure_tokenizer()
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onehop-screenshots-") as scratch:
        folder = Path(scratch)
        (folder / "phoenix").mkdir()
        (folder / "prometheus").mkdir()
        async with phoenix_server(folder / "phoenix") as phoenix:
            tracing = TracingConfig(endpoint=phoenix.otlp_http)
            async with AsyncExitStack() as stack:
                engine_url, _ = await stack.enter_async_context(
                    engine_server(tokenizer, enable_prefix_caching=True, tracing=tracing, backend_options={"itl_ms": 5})
                )
                config = GatewayConfig(
                    model=MODEL, tokenizer=str(tokenizer), engines=[EngineEndpoint(url=engine_url)],
                    route_header=True, tracing=tracing,
                )  # fmt: skip
                base_url, _ = await stack.enter_async_context(configured_gateway(config))
                targets = {"onehop-gateway": base_url.removesuffix("/v1").removeprefix("http://"),
                           "onehop-engine": engine_url.removeprefix("http://")}  # fmt: skip
                prometheus = await stack.enter_async_context(prometheus_server(folder / "prometheus", targets))
                await prometheus.scraped_after(time.time(), scrapes=1)
                traffic = Traffic(base_url, {"user": "unused"}, stack)
                began, rounds = time.monotonic(), 0
                while time.monotonic() - began < seconds:
                    await one_round(traffic, rounds)
                    rounds += 1
                shown = await traffic.chat("user", "derender", stream=True, tools=True)
                await prometheus.scraped_after(time.time())
                print(f"{len(traffic.ledger.sent)} requests in {rounds} rounds")
                queries = [q.expr for q in dashboard_queries(rate_range=RATE_RANGE)]
                for name, needle in GRAPHS.items():
                    expr = next(e for e in queries if needle in e)
                    screenshot(chromium, graph_url(prometheus, expr, seconds), IMAGES / name, (1280, 960))
            # The apps are shut down and their exporters flushed.
            trace = await shown_trace(phoenix, shown.trace_header)
            url = f"{phoenix.url}/projects/{await phoenix.project_id()}/traces/{trace}"
            screenshot(chromium, url, IMAGES / PHOENIX_PNG, (1600, 900))
    STAMP.write_text(stamp_line(dashboard_digest()))
    print(f"wrote {STAMP.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the traffic runs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    # A missing tool is an error naming its install step, not a skip.
    os.environ[prometheus_support.REQUIRED_ENV] = os.environ[phoenix_support.REQUIRED_ENV] = "1"
    if shutil.which(args.chromium) is None:
        sys.exit("chromium is not installed (apt-get install chromium)")
    asyncio.run(run(args.seconds, args.chromium))


if __name__ == "__main__":
    main()
