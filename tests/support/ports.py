"""A server the test starts as a process: a free loopback port for it (it cannot bind port 0 and
say which it got), and the wait until it answers."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import time
from pathlib import Path

import aiohttp


_LOWEST = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, from below the range the OS hands
    out for outgoing connections and port-0 binds: the server given it may bind it only much
    later (a vLLM engine loads its model first, ~30 s), and a port from that range can be
    taken meanwhile by any connection the machine makes (vLLM's own sockets among them)."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1_000:
        for _ in range(200):
            port = random.randrange(_LOWEST, low)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:  # someone's already
                    continue
                return port
    with socket.socket() as probe:  # no room below the range: the OS picks
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; elsewhere the same idea holds closely enough


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
