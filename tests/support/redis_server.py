"""A real `redis-server` of the test's own, on a free loopback port in a temporary folder, with
nothing saved to disk; it can be killed and started again on the same port.

Without `redis-server` on PATH the tests that need it skip, saying so, unless
`ONEHOP_REQUIRE_REDIS` is set (by .ci/run, which installs it): then they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tests.support.waiting import POLL_S
from tests.support.ports import free_port

REQUIRED_ENV = "ONEHOP_REQUIRE_REDIS"
"""Set (by .ci/run): a missing `redis-server` fails the tests that need it instead of skipping them."""
START_S = 10.0


def redis_binary() -> str:
    """The `redis-server` to run; skips (or fails, under `ONEHOP_REQUIRE_REDIS`) without one."""
    found = shutil.which("redis-server")
    if found is None:
        missing = "redis-server is not installed (apt-get install redis-server; .ci/run does)"
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(f"{REQUIRED_ENV} is set but {missing}", pytrace=False)
        pytest.skip(missing)
    return found



class RedisServer:
    """One `redis-server` process at a time on `port`: `kill` it (SIGKILL, as a crash) and
    `start` it again, empty, where clients left it."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary, self.folder = binary, folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        assert self._process is None, "already running"
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
        ]  # fmt: skip
        log = (self.folder / "redis.log").open("ab")
        with log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        await self._wait_ready()

    async def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            await asyncio.to_thread(process.wait)

    async def _wait_ready(self) -> None:
        """Until it answers PING (or fails, showing its log)."""
        client = aioredis.Redis.from_url(self.url, socket_connect_timeout=1.0, socket_timeout=1.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_S
        try:
            while True:
                assert self._process is not None
                if self._process.poll() is not None:
                    raise AssertionError(f"redis-server exited: {(self.folder / 'redis.log').read_text()[-2000:]}")
                try:
                    if await client.ping():
                        return
                except (RedisError, OSError):
                    pass
                if loop.time() >= deadline:
                    raise AssertionError(f"redis-server did not answer on port {self.port} in {START_S} s")
                await asyncio.sleep(POLL_S)  # polling its port: it says nothing when it is ready
        finally:
            await client.aclose()


@asynccontextmanager
async def redis_server(folder: Path) -> AsyncIterator[RedisServer]:
    """A running `redis-server` in `folder`, killed at the end."""
    server = RedisServer(redis_binary(), folder)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()
