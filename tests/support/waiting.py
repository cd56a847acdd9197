"""Wait for a condition, not for a while: a test that syncs on a sleep is slow where it passes and flaky where it does not."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

POLL_S = 0.005


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0, *, what: str = "") -> None:
    """Return once `condition()` holds, polling on the loop; fail naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what or condition.__name__}")
        await asyncio.sleep(POLL_S)
