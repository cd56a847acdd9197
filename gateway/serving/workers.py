"""`onehop gateway --workers N`: N gateway processes on one port, under one supervisor.

One Python process relays on one core; a pod usually has more. Each worker
is a whole gateway (its own event loop, engine connections, renderer and
pools) started as `python -m gateway --config FILE --workers 1` (the gateway
alone, no engine code) with the run's settings in its environment, and every worker listens on the same port with
`SO_REUSEPORT`, so the kernel spreads new connections over them.

The supervisor (this module, in the parent process) does not serve:

- it binds the port first (with `SO_REUSEPORT`, not listening), so port 0
  resolves once and every worker gets the same one, and no other program
  can take the port between worker restarts;
- SIGHUP goes to every worker (each reloads its policy and key files);
  SIGTERM or SIGINT go to every worker, which drain as a single gateway does,
  and the supervisor exits when they have;
- before it starts any worker it checks what every worker would load (the
  port, each model's tokenizer folder, chat templates and parser settings:
  `gateway.serving.preflight`), so a config that cannot serve costs one line, not N
  workers' tracebacks;
- a worker that exits with `EXIT_CONFIG` (a config error only found at its
  start, such as engines serving another model) has written why to the run
  directory; the supervisor prints it once, stops every worker and exits 2,
  restarting nothing;
- a worker that dies otherwise is started again, after a pause that doubles from 1 s
  up to 30 s while workers keep dying within a minute of their start; after
  `GIVE_UP` such quick deaths in a row the supervisor stops every worker and exits 1;
- workers exit with the supervisor, even one killed by SIGKILL: each holds
  the read end of a pipe whose write end only the supervisor holds (end of file: it is
  gone) and, on Linux, asks for SIGTERM when its parent dies (`prctl`);
- the run directory (a temporary folder removed at exit) holds what the
  workers share: prometheus-client's multiprocess files, so any worker's
  `/metrics` answers the sum over all of them, and the Responses store
  (`previous_response_id` works whichever worker a follow-up lands on).

Per worker: admission's queue, and its slots (`admission.max_concurrency`) unless
`state.backend: redis` counts them across workers,
circuit breakers, health checks, the engines' load feedback and the render
cache. Each response names its worker in the `onehop-worker` header.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from yarl import URL

from gateway.serving.preflight import EXIT_CONFIG, StartupError, check_gateway, check_port, port_error, startup_errors
from gateway.serving.worker_env import (
    PORT_ENV,
    RUN_DIR_ENV,
    WORKER_ENV,
    WORKERS_ENV,
    run_dir,
    worker_index,
    worker_port,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's multiprocess mode: read when prometheus_client is first imported."""
PARENT_FD_ENV = "ONEHOP_GATEWAY_PARENT_FD"
"""A worker's read end of a pipe whose write end only the supervisor holds: end of file
means the supervisor is gone, however it died."""
START_ERROR_FILE = "start-error"
"""In the run directory: why a worker could not start (`EXIT_CONFIG`), for the supervisor to print."""
PR_SET_PDEATHSIG = 1
"""Linux prctl(2): the signal a process gets when its parent dies."""

RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0
"""A worker that ran this long resets the restart pause."""
GIVE_UP = 5
"""Quick deaths in a row (each within STABLE_S of its start) after which the supervisor gives up."""
STOP_GRACE_S = 60.0
"""How long workers may drain after SIGTERM before they are killed."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of `onehop gateway`, and of `python -m gateway`, which runs the same."""
    parser.add_argument(
        "--config", type=Path, required=True, metavar="FILE", help="the gateway's YAML config (required)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway processes sharing the port (default: the CPUs this process may use, half of them"
        " when an engine is on this machine's loopback; 1: no supervisor)",
    )


def run_gateway(config_file: Path, workers: int | None) -> int:
    """The gateway alone: one process, a supervisor of `workers`, or (started by one) a worker.
    A config that cannot serve raises `StartupError` before anything starts."""
    from gateway.serving.app import serve
    from gateway.config import ConfigError, load_config

    if worker_index() is not None:
        return serve_worker(config_file)  # its supervisor checked the config
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    count = default_workers(config) if workers is None else workers
    if count < 1:
        raise StartupError("--workers must be at least 1")
    check_port(config.host, config.port)
    check_gateway(config)
    if count == 1:
        with startup_errors(config.host, config.port):
            serve(config)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(config_file, count, config.host, config.port).run()


def default_workers(config: GatewayConfig | None = None) -> int:
    """The CPUs this process may use (`usable_cpus`), half of them (at least one) when one of
    `config`'s engines is on this machine: the engine needs cores too, and a worker without a
    core of its own costs CPU per chunk and delivers fewer chunks (issue #32: on 2 cores shared
    with the engine, 2 workers relayed 25% fewer chunks per second than 1, at 1.5-1.6x the
    CPU per chunk)."""
    cpus = usable_cpus()
    if config is not None and colocated(config):
        return max(1, cpus // 2)
    return cpus


def usable_cpus() -> int:
    """The CPUs this process may use: those it may run on, capped by its cgroup's CPU quota
    (a container limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    return max(1, min(len(os.sched_getaffinity(0)), _cgroup_cpus() or os.cpu_count() or 1))


def colocated(config: GatewayConfig) -> bool:
    """Whether any engine (decode, prefill or a named pool's) is addressed on the loopback:
    it runs on this machine and shares its cores."""
    return any(
        is_loopback(URL(engine.url).host)
        for model in config.served_models()
        for engine in (*model.engines, *model.prefill_engines, *(e for pool in model.pools.values() for e in pool))
    )


def is_loopback(host: str | None) -> bool:
    """`localhost` (and its subdomains, RFC 6761) or a loopback address, IPv4 or IPv6."""
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be this machine
        return False


def _cgroup_cpus(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """cgroup v2's `quota period` as whole CPUs (rounded up); None without a quota."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def serve_worker(config: Path) -> int:
    """One worker's life: exit with the supervisor, serve, and report a config error as one
    line and `EXIT_CONFIG` (the supervisor then stops, restarting nothing)."""
    from gateway.serving.app import serve
    from gateway.config import load_config

    exit_with_parent()
    try:
        with startup_errors("", 0):
            settings = load_config(config)
        with startup_errors(settings.host, worker_port(settings.port)):
            serve(settings)
    except StartupError as exc:
        _report(f"onehop gateway: {exc}")
        return EXIT_CONFIG
    return 0


def _report(message: str) -> None:
    """For the supervisor to print once (every worker would say the same), else on stderr."""
    folder = run_dir()
    if folder is None:
        print(message, file=sys.stderr)
        return
    draft = folder / f"{START_ERROR_FILE}.{os.getpid()}"
    draft.write_text(message + "\n", encoding="utf-8")
    draft.replace(folder / START_ERROR_FILE)


def exit_with_parent() -> None:
    """SIGTERM this process (a graceful drain) when the supervisor dies, even by SIGKILL."""
    _parent_death_signal(signal.SIGTERM)
    value = os.environ.get(PARENT_FD_ENV)
    if value:
        threading.Thread(target=_watch_parent, args=(int(value),), name="parent-watch", daemon=True).start()


def _parent_death_signal(sig: signal.Signals) -> None:
    """Linux only; elsewhere the pipe alone tells (and it also covers a parent that died
    before this call)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _watch_parent(fd: int) -> None:
    try:
        while os.read(fd, 1):  # the supervisor never writes: this returns at its death
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


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
    _config_error: bool = False
    _parent_fd: int = -1

    def run(self) -> int:
        try:
            holder = _hold_port(self.host, self.port)
        except OSError as exc:
            raise StartupError(port_error(self.host, self.port, exc)) from exc
        folder = Path(tempfile.mkdtemp(prefix="onehop-gateway-"))
        (folder / "metrics").mkdir()
        port = holder.getsockname()[1]
        # The write end stays here, never written and never inherited: the kernel closes it
        # when this process dies, however it dies, and every worker reads end of file.
        self._parent_fd, alive = os.pipe()
        env = {
            **os.environ,
            RUN_DIR_ENV: str(folder),
            PORT_ENV: str(port),
            WORKERS_ENV: str(self.workers),
            METRICS_ENV: str(folder / "metrics"),
            PARENT_FD_ENV: str(self._parent_fd),
        }
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
            os.close(self._parent_fd)
            os.close(alive)
            shutil.rmtree(folder, ignore_errors=True)

    def _start(self, slot: _Worker, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "gateway", "--config", str(self.config), "--workers", "1"]
        slot.process = subprocess.Popen(command, env={**env, WORKER_ENV: str(slot.index)}, pass_fds=(self._parent_fd,))
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
            if self._config_error:  # every other worker would fail the same way
                sys.stderr.write(_read_start_error(env[RUN_DIR_ENV]))
                return 2
            if self._quick_deaths >= GIVE_UP:
                log.error(
                    "gateway workers died %d times in a row within %.0f s of their start: giving up", GIVE_UP, STABLE_S
                )
                return 1
            time.sleep(0.1)
        return 0

    def _died(self, slot: _Worker, process: subprocess.Popen[bytes], now: float, metrics: Path) -> None:
        _mark_dead(process.pid, metrics)
        slot.process = None
        if process.returncode == EXIT_CONFIG:
            self._config_error = True
            return
        quick = now - slot.started < STABLE_S
        self._quick_deaths = self._quick_deaths + 1 if quick else 0
        if not quick:
            slot.pause_s = RESTART_MIN_S
        log.error("gateway worker %d (pid %d) exited with %s; starting it again in %.0f s",
                  slot.index, process.pid, process.returncode, slot.pause_s)
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


def _read_start_error(folder: str) -> str:
    try:
        return (Path(folder) / START_ERROR_FILE).read_text(encoding="utf-8")
    except OSError:  # a worker that died before writing it
        return "onehop gateway: a worker could not start with this config\n"


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

    multiprocess.mark_process_dead(pid, str(metrics))  # type: ignore[no-untyped-call]  # unannotated upstream
