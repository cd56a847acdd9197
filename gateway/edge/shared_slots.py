"""Admission slots counted in Redis (`state.backend: redis`), so that `admission.max_concurrency`
and each tenant's `max_concurrency` hold across every worker and replica together.

A request the local queue (`gateway.edge.admission`) admitted takes a lease before it is
served: one Lua script drops expired leases, checks the counts and adds the lease, atomically.
Leases live in sorted sets scored by their expiry (the server's clock); each process renews
its own every `RENEW_S`, so a process that dies without giving its leases back loses them
within `LEASE_S`. A request that finds no lease tries again when this process gives one back,
or after `POLL_S` (another process's release is seen then), until the queue's wait runs out.

Keys (under `state.key_prefix`):

    adm:all          sorted set of lease ids, by expiry
    adm:t:n:<tenant> the same for one tenant's leases (the name percent-encoded; `adm:t:none`
                     for the requests without a tenant), kept only for a tenant with a limit
    adm:waiting      hash: who waits for a lease (process, priority, fairness bucket) → until
                     when, its priority and rank (`state.fairness_sync_s` set)

The local queue orders requests and shares them fairly within each process. Across processes,
with the fairness counters shared (`gateway.edge.shared_fairness`), a request that finds no
lease says so in `adm:waiting` with its priority and its bucket's rank (the tokens it was
served recently, everywhere), and a free slot is not taken by a request while one of a more
urgent priority, or of the same priority and a lower rank, waits for it in another process; it
goes to that one at its next try, within `POLL_S`. Without them, slots go to whichever asks
first once one is free. With the server down or slow
(`state.timeout_s`), the global limits lapse and each process's own hold (fail open: a
request is not refused for want of a counter); the first failure and the recovery are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import uuid
from dataclasses import dataclass
from urllib.parse import quote

from gateway.config import StateConfig
from gateway.redis_state import RedisState, StateDown


LEASE_S = 10.0
"""A lease not renewed for this long is gone: the most a crashed process's slots stay taken."""
RENEW_S = LEASE_S / 4
POLL_S = 0.025
"""How often a request without a lease asks again (another process's release is seen then)."""

WAITING_MS = int(POLL_S * 4 * 1000)
"""A request that found no lease is known to wait (its place in the fair order) this long
after its last try: it tries every `POLL_S` or so, and one that left is forgotten by then."""

GRANTED, SATURATED, TENANT_FULL = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Place:
    """A request's place in the fair order across processes (`gateway.edge.shared_fairness`):
    the more urgent priority first, then the bucket served fewer tokens per weight recently."""

    priority: int
    rank: float
    bucket: str

_TAKE = """
-- ARGV: prefix, lease id, tenant key ('' for none), lease ms, capacity (-1: none), tenant capacity (-1: none),
--       then, for the fair order across processes (absent: none): waiter, priority, rank, bucket, hold ms
local p, id, tenant = ARGV[1], ARGV[2], ARGV[3]
local ttl, cap, tcap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local who = ARGV[7] or ''
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local all, waiting = p .. 'adm:all', p .. 'adm:waiting'
redis.call('ZREMRANGEBYSCORE', all, '-inf', now)
local own, tenant_full = nil, false
if tenant ~= '' then
    own = p .. 'adm:t:' .. tenant
    redis.call('ZREMRANGEBYSCORE', own, '-inf', now)
    tenant_full = tcap >= 0 and redis.call('ZCARD', own) >= tcap
end
local function wait_here()
    local hold = tonumber(ARGV[11])
    redis.call('HSET', waiting, who, (now + hold) .. ' ' .. ARGV[8] .. ' ' .. ARGV[9] .. ' ' .. ARGV[10])
    redis.call('PEXPIRE', waiting, hold)
end
local function someone_ahead()
    local priority, rank = tonumber(ARGV[8]), tonumber(ARGV[9])
    local entries = redis.call('HGETALL', waiting)
    local ahead = false
    for i = 1, #entries, 2 do
        local until_ms, their_priority, their_rank, bucket = string.match(entries[i + 1], '^(%S+) (%S+) (%S+) (.*)$')
        if tonumber(until_ms) < now then
            redis.call('HDEL', waiting, entries[i])
        elseif bucket ~= ARGV[10] then
            their_priority, their_rank = tonumber(their_priority), tonumber(their_rank)
            if their_priority < priority or (their_priority == priority and their_rank < rank) then ahead = true end
        end
    end
    return ahead
end
if cap >= 0 and redis.call('ZCARD', all) >= cap then
    if who ~= '' and not tenant_full then wait_here() end
    return 1
end
if tenant_full then return 2 end
if who ~= '' and someone_ahead() then
    wait_here()
    return 1
end
redis.call('ZADD', all, now + ttl, id)
redis.call('PEXPIRE', all, ttl * 2)
if own then
    redis.call('ZADD', own, now + ttl, id)
    redis.call('PEXPIRE', own, ttl * 2)
end
if who ~= '' then redis.call('HDEL', waiting, who) end
return 0
"""

_RENEW = """
-- ARGV: prefix, lease ms, then pairs of (lease id, tenant key or '')
local p, ttl = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local until_ms = t[1] * 1000 + math.floor(t[2] / 1000) + ttl
for i = 3, #ARGV, 2 do
    redis.call('ZADD', p .. 'adm:all', 'XX', until_ms, ARGV[i])
    if ARGV[i + 1] ~= '' then
        redis.call('ZADD', p .. 'adm:t:' .. ARGV[i + 1], 'XX', until_ms, ARGV[i])
        redis.call('PEXPIRE', p .. 'adm:t:' .. ARGV[i + 1], ttl * 2)
    end
end
redis.call('PEXPIRE', p .. 'adm:all', ttl * 2)
return 0
"""

_GIVE_BACK = """
-- ARGV: prefix, lease id, tenant key or ''
redis.call('ZREM', ARGV[1] .. 'adm:all', ARGV[2])
if ARGV[3] ~= '' then redis.call('ZREM', ARGV[1] .. 'adm:t:' .. ARGV[3], ARGV[2]) end
return 0
"""


class SharedSlots:
    """The leases this process holds in one Redis server, shared with every process naming it."""

    def __init__(self, state: StateConfig, lease_s: float = LEASE_S) -> None:
        self.state = RedisState(state, "admission's shared slots (local limits only meanwhile)")
        self.redis = self.state.redis
        self.prefix = state.key_prefix
        self.lease_ms = int(lease_s * 1000)
        self._take = self.redis.register_script(_TAKE)
        self._renew = self.redis.register_script(_RENEW)
        self._give_back = self.redis.register_script(_GIVE_BACK)
        self._process = f"{uuid.uuid4().hex[:12]}:{os.getpid()}"
        self._ids = (f"{self._process}:{n}" for n in itertools.count())
        self.held: dict[str, str] = {}
        """Lease id → its tenant key ('' for none): what `renew` keeps alive."""
        self._released = asyncio.Event()

    async def take(
        self, tenant: str | None, capacity: int | None, tenant_capacity: int | None, place: Place | None = None
    ) -> tuple[int, str]:
        """(GRANTED and the lease's id) or (SATURATED / TENANT_FULL, ''): one try. With the
        server down: GRANTED with no lease (fail open). With a `place`, a free slot is not
        taken while a request ahead of it waits in another process (SATURATED)."""
        lease, key = next(self._ids), _tenant_key(tenant, tenant_capacity)
        args: list[str | int | float] = [
            self.prefix, lease, key, self.lease_ms,
            -1 if capacity is None else capacity, -1 if tenant_capacity is None else tenant_capacity,
        ]  # fmt: skip
        if place is not None:
            who = f"{self._process}|{place.priority}|{place.bucket}"
            args += [who, place.priority, repr(place.rank), place.bucket, WAITING_MS]
        try:
            answer = int(await self.state.call(self._take(args=args)))
        except StateDown:
            return GRANTED, ""
        if answer == GRANTED:
            self.held[lease] = key
            return GRANTED, lease
        return answer, ""

    async def wait(self) -> None:
        """Until this process gives a lease back, or `POLL_S` (with jitter) passes."""
        self._released.clear()
        try:
            async with asyncio.timeout(POLL_S * random.uniform(0.5, 1.5)):  # jitter: waiters do not ask together
                await self._released.wait()
        except TimeoutError:
            pass

    async def give_back(self, lease: str) -> None:
        key = self.held.pop(lease, None)
        if key is None:
            return
        self._released.set()
        with contextlib.suppress(StateDown):  # else it expires within LEASE_S
            await self.state.call(self._give_back(args=[self.prefix, lease, key]))

    async def renew(self) -> None:
        """Keep this process's leases alive, forever (a background loop)."""
        while True:
            await asyncio.sleep(RENEW_S)
            if self.held:
                pairs = [part for lease, key in list(self.held.items()) for part in (lease, key)]
                with contextlib.suppress(StateDown):  # they live LEASE_S: the next round may reach it
                    await self.state.call(self._renew(args=[self.prefix, self.lease_ms, *pairs]))

    async def close(self) -> None:
        await self.state.close()


def _tenant_key(tenant: str | None, tenant_capacity: int | None) -> str:
    """The tenant's key part; '' when its leases need no count of their own."""
    if tenant_capacity is None:
        return ""
    return "none" if tenant is None else "n:" + quote(tenant, safe="")
