"""Tenant quotas: token buckets, reserved before a request is sent and settled when it ends.

Each of a tenant's limits (`tenants.NAME.tokens_per_minute`, `tokens_per_day`,
`requests_per_minute`) is a token bucket whose capacity is the limit, refilled continuously
at capacity / window (a full bucket after one idle window), so a tenant may burst up to its
limit and then goes on at its rate. A request is checked against all of its tenant's buckets
at once, after render, when its exact prompt is known:

    reserve   prompt tokens + the completion budget (max_tokens, or what the context leaves,
              × n × prompts) from every token bucket, 1 from the requests bucket; all or
              nothing: if any bucket holds less, nothing is taken and the request is refused
              with the time until the emptiest would hold enough. A budget above a bucket's
              capacity is reserved as the capacity, so every request is admissible at all.
    settle    when the request ends (its outcome), the token buckets get back what was
              reserved and pay what was used (prompt + completion; a client that left with
              nothing counted pays its reservation), once: by the reservation's id, so a
              settle repeated (retried after a failure) changes nothing.

A settle may take a bucket below zero (a request used more than its capped reservation): the
debt delays the tenant's next requests, so what is admitted over any window stays within the
limit plus one request's size. The memory store (`MemoryQuotas`) holds the buckets of this
process; `gateway.edge.redis_quota` holds them in Redis for every worker and replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.config import Tenant

LimitName = Literal["tokens_per_minute", "tokens_per_day", "requests_per_minute"]
MINUTE_S, DAY_S = 60.0, 86_400.0


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket of a tenant: its capacity, refilled in full over `window_s`."""

    name: LimitName
    capacity: int
    window_s: float

    @property
    def tokens(self) -> bool:
        """Counts tokens (reserved, then settled) rather than requests (counted when admitted)."""
        return self.name != "requests_per_minute"

    def wanted(self, tokens: int) -> int:
        """What a request of `tokens` takes from this bucket: its tokens, at most the
        capacity (so a request larger than the bucket can still be admitted, into debt)."""
        return min(tokens, self.capacity) if self.tokens else 1

    def refilled(self, level: float, elapsed_s: float) -> float:
        return min(float(self.capacity), level + max(0.0, elapsed_s) * self.capacity / self.window_s)

    def wait_s(self, level: float, amount: float) -> float:
        """Until a bucket at `level` holds `amount`."""
        return max(0.0, (amount - level) * self.window_s / self.capacity)


def limits_of(tenant: Tenant, share: int = 1) -> tuple[Limit, ...]:
    """A tenant's limits, each divided by `share` (the workers of `--workers N` on the memory
    store each hold 1/N of it, at least 1)."""
    found: list[Limit] = []
    for name, value, window in (
        ("tokens_per_minute", tenant.tokens_per_minute, MINUTE_S),
        ("tokens_per_day", tenant.tokens_per_day, DAY_S),
        ("requests_per_minute", tenant.requests_per_minute, MINUTE_S),
    ):
        if value is not None:
            found.append(Limit(name, max(1, value // share), window))  # type: ignore[arg-type]  # the loop's literals
    return tuple(found)


@dataclass(frozen=True, slots=True)
class Level:
    """A bucket after a reserve (or after the refused try): what the answer's headers say."""

    limit: Limit
    remaining: int
    """Whole tokens (or requests) left, 0 when in debt."""
    reset_s: float
    """Until the bucket is full again."""


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    levels: tuple[Level, ...]
    retry_after_s: float = 0.0
    """Refused: until every bucket would hold what the request needs."""
    refused_by: LimitName | None = None
    """Refused: the bucket that needs the longest wait."""

    def level(self, name: LimitName) -> Level | None:
        return next((level for level in self.levels if level.limit.name == name), None)


class QuotaStore(Protocol):
    """Where the buckets live: this process (`MemoryQuotas`) or Redis (`RedisQuotas`).
    Either raises `StateUnavailable` when it cannot answer."""

    async def reserve(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int) -> Decision: ...

    async def settle(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int | None) -> bool:
        """Charge `tokens` for `reservation` in place of what it reserved (None: what it
        reserved stands); False when it was settled before (or is unknown): nothing changes."""
        ...

    async def close(self) -> None: ...


class MemoryQuotas:
    """The buckets of this process, in a dict: exact for one process, and what each worker of
    `--workers N` holds of 1/N of every limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, LimitName], tuple[float, float]] = {}
        """(tenant, limit) → (level, when it was that)."""
        self._reserved: dict[str, dict[LimitName, int]] = {}

    def _level(self, tenant: str, limit: Limit, now: float) -> float:
        found = self._buckets.get((tenant, limit.name))
        return float(limit.capacity) if found is None else limit.refilled(found[0], now - found[1])

    async def reserve(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int) -> Decision:
        now = self._clock()
        levels = [self._level(tenant, limit, now) for limit in limits]
        wanted = [limit.wanted(tokens) for limit in limits]
        return self._decide(tenant, reservation, limits, levels, wanted, now)

    def _decide(
        self,
        tenant: str,
        reservation: str,
        limits: Sequence[Limit],
        levels: list[float],
        wanted: list[int],
        now: float,
    ) -> Decision:
        waits = [limit.wait_s(level, amount) for limit, level, amount in zip(limits, levels, wanted, strict=True)]
        if any(waits):
            worst = max(range(len(limits)), key=waits.__getitem__)
            return Decision(False, _levels(limits, levels), waits[worst], limits[worst].name)
        after = [level - amount for level, amount in zip(levels, wanted, strict=True)]
        for limit, level in zip(limits, after, strict=True):
            self._buckets[(tenant, limit.name)] = (level, now)
        self._reserved[reservation] = {
            limit.name: amount for limit, amount in zip(limits, wanted, strict=True) if limit.tokens
        }
        return Decision(True, _levels(limits, after))

    async def settle(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int | None) -> bool:
        reserved = self._reserved.pop(reservation, None)
        if reserved is None:
            return False
        if tokens is None:
            return True
        now = self._clock()
        for limit in limits:
            amount = reserved.get(limit.name)
            if amount is not None:
                level = self._level(tenant, limit, now) - (tokens - amount)
                self._buckets[(tenant, limit.name)] = (min(float(limit.capacity), level), now)
        return True

    async def close(self) -> None:
        return None


def _levels(limits: Sequence[Limit], levels: Sequence[float]) -> tuple[Level, ...]:
    return tuple(
        Level(limit, max(0, math.floor(level)), limit.wait_s(level, limit.capacity))
        for limit, level in zip(limits, levels, strict=True)
    )
