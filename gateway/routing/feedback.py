"""Live feedback for the cost policy: each engine's output-processing CPU rate.

Every `interval` the gateway scrapes each engine's `/metrics` and turns the
growth of `onehop_engine_output_cpu_seconds_total` (all modes) into cores in
use, plus the in-flight count. Engines without those metrics (stock vLLM)
read as idle. A failed scrape, or an answer that is not Prometheus text,
keeps that engine's last reading: feedback is advisory, and one engine's
failure never stops the others'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)

CPU_METRIC = "onehop_engine_output_cpu_seconds_total"
IN_FLIGHT_METRIC = "onehop_engine_in_flight_requests"
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    cpu_seconds: float
    in_flight: int


@dataclass(frozen=True, slots=True)
class Load:
    output_cpu_cores: float = 0.0
    in_flight: int = 0


def parse_sample(text: str, at: float) -> Sample:
    """The two metrics the policy reads, found line by line. prometheus_client's parser, over
    an engine's whole exposition (about 22 KB once every mode has served), took 2.6 ms a
    scrape: a few µs of every relayed chunk at low load. Raises ValueError for text that is
    not Prometheus exposition (an HTML error page)."""
    cpu = 0.0
    in_flight = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if not (line[0].isalpha() or line[0] in "_:"):
            raise ValueError(f"not a Prometheus sample line: {line[:80]!r}")
        if line.startswith(CPU_METRIC):
            cpu += _value(line, len(CPU_METRIC))
        elif line.startswith(IN_FLIGHT_METRIC):
            in_flight += _value(line, len(IN_FLIGHT_METRIC))
    return Sample(at=at, cpu_seconds=cpu, in_flight=int(in_flight))


def _value(line: str, name_end: int) -> float:
    """A sample line's value (`name{labels} value [timestamp]`); 0 for another metric whose
    name only starts with the one looked for."""
    rest = line[name_end:]
    if rest.startswith("{"):
        rest = rest[rest.rindex("}") + 1 :]  # label values may hold anything but the last brace
    elif not rest.startswith(" "):
        return 0.0
    parts = rest.split()
    if not parts:
        raise ValueError(f"a Prometheus sample without a value: {line[:80]!r}")
    return float(parts[0])


def load_between(before: Sample, after: Sample) -> Load:
    """Cores the engine spent on output processing between two scrapes."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        return Load(in_flight=after.in_flight)
    return Load(
        output_cpu_cores=max(0.0, (after.cpu_seconds - before.cpu_seconds) / elapsed), in_flight=after.in_flight
    )


class EngineFeedback:
    """The latest `Load` of every engine, refreshed by `run()`."""

    def __init__(self, urls: Callable[[], list[str]], interval: float) -> None:
        """`urls()` names the engines to scrape now (pools change with DNS)."""
        self._urls = urls
        self._interval = interval
        self._last: dict[str, Sample] = {}
        self.loads: dict[str, Load] = {}

    def load(self, url: str) -> Load:
        return self.loads.get(url, Load())

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self.scrape(session, url) for url in self._urls()))
            await asyncio.sleep(self._interval)

    async def scrape(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with session.get(url + "/metrics") as response:
                    if response.status != 200:
                        return
                    text = await response.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("metrics scrape of %s failed: %s", url, exc)
            return
        try:
            sample = parse_sample(text, time.monotonic())
        except ValueError as exc:  # not Prometheus text (an HTML page, a proxy's error): this engine only
            log.warning("metrics of %s are not Prometheus text: %s", url, exc)
            return
        before = self._last.get(url)
        self._last[url] = sample
        if before is not None:
            self.loads[url] = load_between(before, sample)
