"""A real `prometheus` of the test's own: on a free loopback port, in a temporary folder, scraping
the given targets every second, queried through its HTTP API as Grafana queries it.

Without `prometheus` on PATH the tests that need it skip, saying so, unless
`ONEHOP_REQUIRE_PROMETHEUS` is set (by .ci/run, which installs it): then they fail.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.support.ports import free_port, until_answering
from tests.support.waiting import POLL_S

REQUIRED_ENV = "ONEHOP_REQUIRE_PROMETHEUS"
"""Set (by .ci/run): a missing `prometheus` fails the tests that need it instead of skipping them."""
SCRAPE_S = 1.0
START_S = 30.0
SCRAPED_S = 20.0
"""Longest wait for the scrapes after a moment (the first comes up to ~6 s after the start)."""


class PrometheusError(AssertionError):
    """Prometheus answered a query with an error, or did not come up."""


def prometheus_binary() -> str:
    """The `prometheus` to run; skips (or fails, under `ONEHOP_REQUIRE_PROMETHEUS`) without one."""
    found = shutil.which("prometheus")
    if found is None:
        missing = "prometheus is not installed (apt-get install prometheus; .ci/run does)"
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(f"{REQUIRED_ENV} is set but {missing}", pytrace=False)
        pytest.skip(missing)
    return found


def scrape_config(targets: Mapping[str, str]) -> dict[str, Any]:
    """A config scraping each `job: host:port` every `SCRAPE_S` (configs/prometheus.yml says 15 s:
    a test cannot wait for that)."""
    interval = f"{SCRAPE_S:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()
        ],
    }


class Prometheus:
    """A running server's HTTP API: instant queries, and a wait for the scrapes after a moment."""

    def __init__(self, url: str, session: aiohttp.ClientSession, jobs: int) -> None:
        self.url, self._session, self._jobs = url, session, jobs

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """The series an instant query returns now: `[{"metric": {...}, "value": [t, "v"]}, ...]`
        (`"values": [[t, "v"], ...]` for a range selector; a scalar or string result is one series
        without labels)."""
        async with self._session.get(self.url + "/api/v1/query", params={"query": expr}) as resp:
            answer = await resp.json()
        if answer.get("status") != "success":
            raise PrometheusError(f"{expr!r}: {answer.get('errorType')}: {answer.get('error')}")
        data = answer["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    async def values(self, expr: str, by: tuple[str, ...]) -> dict[tuple[str, ...], float]:
        """An instant query's values keyed by the labels `by` names (absent labels as '')."""
        return {
            tuple(series["metric"].get(label, "") for label in by): float(series["value"][1])
            for series in await self.query(expr)
        }

    async def scraped_after(self, moment: float, scrapes: int = 2) -> None:
        """Until every target was scraped `scrapes` times after `moment` (a Unix time): a rate
        needs two samples of each series, one created by the last request included. (The first
        scrape comes seconds after the start: Prometheus applies its config on a 5 s tick.)"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SCRAPED_S
        while True:
            window = max(1, math.ceil(time.time() - moment) + 1)
            counts = [
                sum(1 for stamp, _ in series["values"] if float(stamp) > moment)
                for series in await self.query(f"up[{window}s]")
            ]
            if len(counts) >= self._jobs and min(counts) >= scrapes:
                return
            if loop.time() >= deadline:
                raise PrometheusError(f"targets scraped {counts} times after {moment:.3f}, not {scrapes}, in {SCRAPED_S} s")
            await asyncio.sleep(POLL_S * 20)  # polling its API: Prometheus tells no one when it scraped


@asynccontextmanager
async def prometheus_server(folder: Path, targets: Mapping[str, str]) -> AsyncIterator[Prometheus]:
    """`prometheus` scraping `targets` (job name → host:port), its data and log in `folder`,
    stopped at the end."""
    binary = prometheus_binary()
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(targets)))
    port = free_port()
    args = [
        binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    with (folder / "prometheus.log").open("ab") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}"
            await until_answering(
                session, url + "/-/ready", process, folder / "prometheus.log", within_s=START_S, every_s=POLL_S * 10, error=PrometheusError
            )
            yield Prometheus(url, session, len(targets))
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait)

