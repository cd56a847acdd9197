"""Admission control: at most `max_concurrency` requests served at once.

Beyond that, up to `max_queue` requests wait (first come, first served) for
at most `queue_timeout_s`; anything more, or a wait that runs out, is a 429
with `Retry-After` at once, so an overloaded gateway answers quickly instead
of letting clients time out. The slot is held until the last byte of the
answer, streams included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from gateway.config import Admission
from gateway.edge.errors import RateLimited


class Gate:
    def __init__(
        self,
        config: Admission,
        on_reject: Callable[[], None] = lambda: None,
        on_waiting: Callable[[int], None] = lambda waiting: None,
    ) -> None:
        self.config = config
        self._on_reject = on_reject
        self._on_waiting = on_waiting
        self._slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency is not None else None
        self.waiting = 0
        self.rejected = 0

    def _refuse(self, why: str) -> RateLimited:
        self.rejected += 1
        self._on_reject()
        error = RateLimited(f"the gateway is at capacity ({why}); retry after {self.config.retry_after_s} s")
        error.headers = {"Retry-After": str(self.config.retry_after_s)}
        return error

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        slots = self._slots
        if slots is None:
            yield
            return
        if slots.locked():
            if self.waiting >= self.config.max_queue:
                raise self._refuse(f"{self.config.max_concurrency} running, {self.waiting} waiting")
            self.waiting += 1
            self._on_waiting(self.waiting)
            try:
                async with asyncio.timeout(self.config.queue_timeout_s):
                    await slots.acquire()
            except TimeoutError:
                raise self._refuse(f"no slot within {self.config.queue_timeout_s} s") from None
            finally:
                self.waiting -= 1
                self._on_waiting(self.waiting)
        else:
            await slots.acquire()  # free: returns at once
        try:
            yield
        finally:
            slots.release()
