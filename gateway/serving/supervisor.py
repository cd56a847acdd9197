"""The gateway's background loops, under one supervisor that keeps them running.

Health checks, DNS refreshes, feedback scraping and file watching each run
forever (a loop with nothing to do returns at once, and is done). A loop
that fails is logged with its traceback, counted
in `onehop_gateway_background_restarts_total{loop}` and started again after
`restart_s`: one engine answering garbage, or one unreadable file, must not
stop the work for every other engine or for the next good file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

RESTART_S = 1.0


class Supervisor:
    def __init__(self, on_restart: Callable[[str], None] = lambda name: None, *, restart_s: float = RESTART_S) -> None:
        self._on_restart = on_restart
        self._restart_s = restart_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop()` in the background, again whenever it ends; `name` labels logs and metrics."""
        self._tasks.append(asyncio.ensure_future(self._keep(name, loop)))

    async def _keep(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await loop()
                return  # nothing (more) to do: a pool with no name to resolve, say
            except Exception:
                log.exception("background loop %s failed; starting it again in %s s", name, self._restart_s)
            self._on_restart(name)
            await asyncio.sleep(self._restart_s)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
