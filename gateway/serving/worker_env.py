"""What a worker of `onehop gateway --workers N` learns from its supervisor (`gateway.serving.workers`):
its index, the run's shared folder and the port, all through its environment.

Apart from the supervisor so that what a worker runs (the app, the shared Responses store)
reads them without importing the supervisor, which starts that app.
"""

from __future__ import annotations

import os
from pathlib import Path

WORKER_ENV = "ONEHOP_GATEWAY_WORKER"
"""A worker's index (0..N-1): set in the workers only."""
RUN_DIR_ENV = "ONEHOP_GATEWAY_RUN_DIR"
"""The folder the workers of one run share (metrics files, the Responses store)."""
WORKERS_ENV = "ONEHOP_GATEWAY_WORKERS"
"""How many workers the run has: each holds its share of the memory quota store's limits."""
PORT_ENV = "ONEHOP_GATEWAY_PORT"
"""The port the supervisor bound: it overrides the config's (which may be 0)."""
WORKER_HEADER = "onehop-worker"
"""The response header that names the worker that answered."""


def worker_index() -> int | None:
    value = os.environ.get(WORKER_ENV)
    return int(value) if value is not None else None


def worker_count() -> int:
    """The run's workers (1 outside `--workers N`)."""
    value = os.environ.get(WORKERS_ENV)
    return max(1, int(value)) if value else 1


def run_dir() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def worker_port(configured: int) -> int:
    value = os.environ.get(PORT_ENV)
    return int(value) if value else configured
