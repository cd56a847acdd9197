"""`onehop gateway --workers N`: N gateway processes on one port, under one supervisor.

One Python process relays on one core; a pod usually has more. Each worker
is a whole gateway (its own event loop, engine connections, renderer and
pools) started as `onehop gateway --config FILE --workers 1` with the run's
settings in its environment, and every worker listens on the same port with
`SO_REUSEPORT`, so the kernel spreads new connections over them.

The supervisor (this module, in the parent process) does not serve:

- it binds the port first (with `SO_REUSEPORT`, not listening), so port 0
  resolves once and every worker gets the same one, and no other program
  can take the port between worker restarts;
- SIGHUP goes to every worker (each reloads its policy and key files);
  SIGTERM or SIGINT go to every worker, which drain as a single gateway does,
  and the supervisor exits when they have;
- a worker that dies is started again, after a pause that doubles from 1 s
  up to 30 s while workers keep dying within a minute of their start; after
  `GIVE_UP` such quick deaths in a row (a config that cannot start, a port
  taken) the supervisor stops every worker and exits 1;
- the run directory (a temporary folder removed at exit) holds what the
  workers share: prometheus-client's multiprocess files, so any worker's
  `/metrics` answers the sum over all of them, and the Responses store
  (`previous_response_id` works whichever worker a follow-up lands on).

Per worker: admission limits (`admission.max_concurrency` and the queue),
circuit breakers, health checks, the engines' load feedback and the render
cache. Each response names its worker in the `onehop-worker` header.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_ENV = "ONEHOP_GATEWAY_WORKER"
"""A worker's index (0..N-1): set in the workers only."""
RUN_DIR_ENV = "ONEHOP_GATEWAY_RUN_DIR"
"""The folder the workers of one run share (metrics files, the Responses store)."""
PORT_ENV = "ONEHOP_GATEWAY_PORT"
"""The port the supervisor bound: it overrides the config's (which may be 0)."""
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's multiprocess mode: read when prometheus_client is first imported."""
WORKER_HEADER = "onehop-worker"

RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0
"""A worker that ran this long resets the restart pause."""
GIVE_UP = 5
"""Quick deaths in a row (each within STABLE_S of its start) after which the supervisor gives up."""
STOP_GRACE_S = 60.0
"""How long workers may drain after SIGTERM before they are killed."""


def default_workers() -> int:
    """The CPUs this process may use: those it may run on, capped by its cgroup's CPU quota
    (a container limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    return max(1, min(len(os.sched_getaffinity(0)), _cgroup_cpus() or os.cpu_count() or 1))


def _cgroup_cpus(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """cgroup v2's `quota period` as whole CPUs (rounded up); None without a quota."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def worker_index() -> int | None:
    value = os.environ.get(WORKER_ENV)
    return int(value) if value is not None else None


def run_dir() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def worker_port(configured: int) -> int:
    value = os.environ.get(PORT_ENV)
    return int(value) if value else configured


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    pause_s: float = RESTART_MIN_S
    restart_at: float | None = None


@dataclass
class Supervisor:
    config: Path
    workers: int
    host: str
    port: int
    _stopping: bool = False
    _slots: list[_Worker] = field(default_factory=list)
    _quick_deaths: int = 0

    def run(self) -> int:
        folder = Path(tempfile.mkdtemp(prefix="onehop-gateway-"))
        (folder / "metrics").mkdir()
        holder = _hold_port(self.host, self.port)
        port = holder.getsockname()[1]
        env = {**os.environ, RUN_DIR_ENV: str(folder), PORT_ENV: str(port), METRICS_ENV: str(folder / "metrics")}
        signal.signal(signal.SIGHUP, lambda *_: self._forward(signal.SIGHUP))
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, lambda *_: self._stop())
        log.info("onehop gateway: %d workers on http://%s:%d", self.workers, self.host, port)
        try:
            self._slots = [_Worker(i) for i in range(self.workers)]
            for slot in self._slots:
                self._start(slot, env)
            return self._watch(env, folder / "metrics")
        finally:
            self._stop()
            self._reap()
            holder.close()
            shutil.rmtree(folder, ignore_errors=True)

    def _start(self, slot: _Worker, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "gateway", "gateway", "--config", str(self.config), "--workers", "1"]
        slot.process = subprocess.Popen(command, env={**env, WORKER_ENV: str(slot.index)})
        slot.started = time.monotonic()
        slot.restart_at = None

    def _watch(self, env: dict[str, str], metrics: Path) -> int:
        while not self._stopping:
            now = time.monotonic()
            for slot in self._slots:
                process = slot.process
                if slot.restart_at is not None and now >= slot.restart_at:
                    self._start(slot, env)
                elif process is not None and process.poll() is not None:
                    self._died(slot, process, now, metrics)
            if self._quick_deaths >= GIVE_UP:
                log.error("gateway workers died %d times in a row within %.0f s of their start: giving up", GIVE_UP, STABLE_S)
                return 1
            time.sleep(0.1)
        return 0

    def _died(self, slot: _Worker, process: subprocess.Popen[bytes], now: float, metrics: Path) -> None:
        _mark_dead(process.pid, metrics)
        quick = now - slot.started < STABLE_S
        self._quick_deaths = self._quick_deaths + 1 if quick else 0
        if not quick:
            slot.pause_s = RESTART_MIN_S
        log.error("gateway worker %d (pid %d) exited with %s; starting it again in %.0f s",
                  slot.index, process.pid, process.returncode, slot.pause_s)
        slot.process = None
        slot.restart_at = now + slot.pause_s
        slot.pause_s = min(slot.pause_s * 2, RESTART_MAX_S)

    def _forward(self, sig: int) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(sig)

    def _stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._forward(signal.SIGTERM)

    def _reap(self) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        for slot in self._slots:
            if slot.process is None:
                continue
            try:
                slot.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("gateway worker %d did not stop within %s s: killing it", slot.index, STOP_GRACE_S)
                slot.process.kill()
                slot.process.wait()


def _hold_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) the port with SO_REUSEPORT: workers bind it too, and only they accept."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, port))
    return holder


def _mark_dead(pid: int, metrics: Path) -> None:
    """Drop a dead worker's live gauges (in-flight, waiting) from the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics))
