"""How many workers `onehop gateway` starts by default."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from gateway.config import GatewayConfig
from gateway.serving.workers import _cgroup_cpus, default_workers, is_loopback, usable_cpus


def test_a_cgroup_quota_is_counted_in_whole_cpus(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert _cgroup_cpus(cpu_max) == 2
    cpu_max.write_text("50000 100000\n")
    assert _cgroup_cpus(cpu_max) == 1
    cpu_max.write_text("max 100000\n")
    assert _cgroup_cpus(cpu_max) is None
    assert _cgroup_cpus(tmp_path / "missing") is None


def test_the_default_is_at_most_the_cpus_this_process_may_run_on() -> None:
    assert 1 <= default_workers() <= len(os.sched_getaffinity(0))


def _config(*urls: str, prefill: tuple[str, ...] = (), pool: tuple[str, ...] = ()) -> GatewayConfig:
    return msgspec.convert(
        {
            "model": "m",
            "tokenizer": "/models/m",
            "engines": [{"url": url} for url in urls],
            "prefill_engines": [{"url": url} for url in prefill],
            "pools": {"big": [{"url": url} for url in pool]} if pool else {},
        },
        GatewayConfig,
    )


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.3.0.9", True), ("::1", True), ("localhost", True), ("engine.localhost", True),
     ("10.0.0.5", False), ("::ffff:10.0.0.5", False), ("engine-0.engines.svc", False), (None, False)],
)
def test_loopback_hosts(host: str | None, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_engine_on_this_machine_takes_half_the_cpus() -> None:
    cpus = usable_cpus()
    assert default_workers(_config("http://10.0.0.5:8000")) == cpus
    assert default_workers(_config("http://10.0.0.5:8000", "http://127.0.0.1:8001")) == max(1, cpus // 2)
    assert default_workers(_config("http://10.0.0.5:8000", prefill=("http://localhost:8100",))) == max(1, cpus // 2)
    assert default_workers(_config("http://10.0.0.5:8000", pool=("http://[::1]:8200",))) == max(1, cpus // 2)
    assert default_workers() == cpus
