"""The gateway's connection to the shared state's Redis server (`state.backend: redis`).

The Responses store, the tenant quotas and admission's shared slots each hold one `RedisState`:
a client with its own connection pool, each call bounded by `state.timeout_s`, and a log line
when the server stops answering and when it answers again (once each way, not per call). A
call that fails raises `StateDown` (admission falls back to its local limits), or with `serve`
the request's 503 `state_unavailable` (the Responses store, the quotas).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import StateConfig
from gateway.edge.errors import StateUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class StateDown(Exception):
    """The server did not answer within `state.timeout_s`, refused, or is unreachable."""


class RedisState:
    def __init__(self, state: StateConfig, what: str) -> None:
        """`what` names the user in the log lines ("the Responses store")."""
        assert state.url is not None  # StateConfig requires it for the redis backend
        self.prefix = state.key_prefix
        self.timeout_s = state.timeout_s
        self.what = what
        # No retries past one at once (a pooled connection the server's restart broke): a call
        # is bounded by `timeout_s` anyway, and its caller decides what a failure means.
        self.redis = aioredis.Redis.from_url(
            state.url,
            socket_timeout=state.timeout_s,
            socket_connect_timeout=state.timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self.down = False

    async def call(self, operation: Awaitable[T]) -> T:
        """`operation` within `timeout_s`; a server down, slow or refusing is `StateDown`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await operation
        except (RedisError, OSError, TimeoutError) as exc:
            if not self.down:
                log.warning("%s (Redis) is unavailable: %s", self.what, reason(exc))
            self.down = True
            raise StateDown(reason(exc)) from exc
        if self.down:
            log.warning("%s (Redis) is available again", self.what)
            self.down = False
        return result

    async def serve(self, operation: Awaitable[T]) -> T:
        """`call`, for a request that needs the answer: a failure is its 503."""
        try:
            return await self.call(operation)
        except StateDown as exc:
            raise StateUnavailable(f"{self.what} is unavailable ({exc}); retry later") from exc

    async def close(self) -> None:
        await self.redis.aclose()


def reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in state.timeout_s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
