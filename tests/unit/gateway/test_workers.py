"""How many workers `onehop gateway` starts by default."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.serving.workers import _cgroup_cpus, default_workers


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
