"""A server the test starts as a process: a free loopback port for it (it cannot bind port 0 and
say which it got), and the wait until it answers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path

import aiohttp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def until_answering(
    session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes], log: Path, *,
    within_s: float, every_s: float, error: type[Exception],
) -> None:
    """Until `url` answers 200; `error` (with the log's tail) if the process exits or `within_s`
    passes first. Polled: such a server says nothing when it is ready."""
    deadline = time.monotonic() + within_s
    while True:
        if process.poll() is not None:
            raise error(f"{log.stem} exited: {log.read_text()[-3000:]}")
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() >= deadline:
            raise error(f"{log.stem} did not answer at {url} within {within_s} s")
        await asyncio.sleep(every_s)
