"""Live feedback from the engines' metrics into the pools' datastores (`Endpoint.load`).

Every `interval` the gateway scrapes each engine's `/metrics`: the growth of
`onehop_engine_output_cpu_seconds_total` (all modes) becomes cores in use and
`onehop_engine_in_flight_requests` the in-flight count (for the route policy's cost
model); vLLM's `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` the queue and the
cache fill, and `vllm:cache_config_info`'s `num_gpu_blocks` the cache's size (for kv_cache
balancing). A metric an engine lacks reads 0 (stock vLLM has no onehop metrics). A failed
scrape, or an answer that is not Prometheus text, keeps that engine's last reading: feedback
is advisory, and one engine's failure never stops the others'.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from gateway.routing.datastore import EndpointStore, Load

log = logging.getLogger(__name__)

CPU_METRIC = "onehop_engine_output_cpu_seconds_total"
IN_FLIGHT_METRIC = "onehop_engine_in_flight_requests"
WAITING_METRIC = "vllm:num_requests_waiting"
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
CACHE_CONFIG_METRIC = "vllm:cache_config_info"
_GPU_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    cpu_seconds: float
    in_flight: int
    waiting: int = 0
    kv_usage: float = 0.0
    cache_blocks: int = 0


def parse_sample(text: str, at: float) -> Sample:
    """The metrics the gateway reads, found line by line (summed over their label sets: an
    engine's data-parallel ranks; the KV usage is their mean). prometheus_client's parser,
    over an engine's whole exposition (about 22 KB once every mode has served), took 2.6 ms
    a scrape: a few µs of every relayed chunk at low load. Raises ValueError for text that is
    not Prometheus exposition (an HTML error page)."""
    cpu = in_flight = waiting = usage = 0.0
    usage_series = cache_blocks = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if not (line[0].isalpha() or line[0] in "_:"):
            raise ValueError(f"not a Prometheus sample line: {line[:80]!r}")
        if line.startswith(CPU_METRIC):
            cpu += _value(line, len(CPU_METRIC))
        elif line.startswith(IN_FLIGHT_METRIC):
            in_flight += _value(line, len(IN_FLIGHT_METRIC))
        elif line.startswith(WAITING_METRIC):
            waiting += _value(line, len(WAITING_METRIC))
        elif line.startswith(KV_USAGE_METRIC) and _is_sample(line, len(KV_USAGE_METRIC)):
            usage += _value(line, len(KV_USAGE_METRIC))
            usage_series += 1
        elif line.startswith(CACHE_CONFIG_METRIC) and _is_sample(line, len(CACHE_CONFIG_METRIC)):
            blocks = _GPU_BLOCKS.search(line)  # one series per data-parallel rank, each its own cache
            cache_blocks += int(blocks.group(1)) if blocks else 0
    kv_usage = min(max(usage / usage_series, 0.0), 1.0) if usage_series else 0.0
    return Sample(
        at=at, cpu_seconds=cpu, in_flight=int(in_flight), waiting=int(waiting), kv_usage=kv_usage,
        cache_blocks=cache_blocks,
    )


def _is_sample(line: str, name_end: int) -> bool:
    """The line is a sample of exactly this metric (not of one whose name only starts so)."""
    return line[name_end : name_end + 1] in ("{", " ")


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
    cores = max(0.0, (after.cpu_seconds - before.cpu_seconds) / elapsed) if elapsed > 0 else 0.0
    return Load(
        output_cpu_cores=cores, in_flight=after.in_flight, waiting=after.waiting, kv_usage=after.kv_usage,
        cache_blocks=after.cache_blocks,
    )


class EngineFeedback:
    """Keeps every engine's `Load` in its pools' datastores, refreshed by `run()`."""

    def __init__(self, stores: Callable[[], Iterable[EndpointStore]], interval: float) -> None:
        """`stores()` names the pools to scrape now (their members change with DNS)."""
        self._stores = stores
        self._interval = interval
        self._last: dict[str, Sample] = {}

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            urls = {url for store in self._stores() for url in store.endpoints}
            self._last = {url: sample for url, sample in self._last.items() if url in urls}  # DNS leavers
            loads = await asyncio.gather(*(self.scrape(session, url) for url in urls))
            found = {url: load for url, load in zip(urls, loads, strict=True) if load is not None}
            for store in self._stores():
                for url, endpoint in store.endpoints.items():
                    if url in found:
                        endpoint.load = found[url]
            await asyncio.sleep(self._interval)

    async def scrape(self, session: aiohttp.ClientSession, url: str) -> Load | None:
        """The engine's load since its last scrape; None when unknown (kept as it was)."""
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with session.get(url + "/metrics") as response:
                    if response.status != 200:
                        return None
                    text = await response.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("metrics scrape of %s failed: %s", url, exc)
            return None
        try:
            sample = parse_sample(text, time.monotonic())
        except ValueError as exc:  # not Prometheus text (an HTML page, a proxy's error): this engine only
            log.warning("metrics of %s are not Prometheus text: %s", url, exc)
            return None
        before = self._last.get(url)
        self._last[url] = sample
        return load_between(before or sample, sample)  # the first: no CPU rate yet, the rest read
