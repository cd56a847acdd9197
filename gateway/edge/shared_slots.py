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

The local queue still orders requests and shares them fairly within each process; across
processes, slots go to whichever asks first once one is free. With the server down or slow
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
from urllib.parse import quote


from gateway.config import StateConfig
from gateway.redis_state import RedisState, StateDown


LEASE_S = 10.0
"""A lease not renewed for this long is gone: the most a crashed process's slots stay taken."""
RENEW_S = LEASE_S / 4
POLL_S = 0.025
"""How often a request without a lease asks again (another process's release is seen then)."""

GRANTED, SATURATED, TENANT_FULL = 0, 1, 2

_TAKE = """
-- ARGV: prefix, lease id, tenant key ('' for none), lease ms, capacity (-1: none), tenant capacity (-1: none)
local p, id, tenant = ARGV[1], ARGV[2], ARGV[3]
local ttl, cap, tcap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local all = p .. 'adm:all'
redis.call('ZREMRANGEBYSCORE', all, '-inf', now)
if cap >= 0 and redis.call('ZCARD', all) >= cap then return 1 end
local own = nil
if tenant ~= '' then
    own = p .. 'adm:t:' .. tenant
    redis.call('ZREMRANGEBYSCORE', own, '-inf', now)
    if tcap >= 0 and redis.call('ZCARD', own) >= tcap then return 2 end
end
redis.call('ZADD', all, now + ttl, id)
redis.call('PEXPIRE', all, ttl * 2)
if own then
    redis.call('ZADD', own, now + ttl, id)
    redis.call('PEXPIRE', own, ttl * 2)
end
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
        self._ids = (f"{uuid.uuid4().hex[:12]}:{os.getpid()}:{n}" for n in itertools.count())
        self.held: dict[str, str] = {}
        """Lease id → its tenant key ('' for none): what `renew` keeps alive."""
        self._released = asyncio.Event()

    async def take(self, tenant: str | None, capacity: int | None, tenant_capacity: int | None) -> tuple[int, str]:
        """(GRANTED and the lease's id) or (SATURATED / TENANT_FULL, ''): one try. With the
        server down: GRANTED with no lease (fail open)."""
        lease, key = next(self._ids), _tenant_key(tenant, tenant_capacity)
        args = [
            self.prefix, lease, key, self.lease_ms,
            -1 if capacity is None else capacity, -1 if tenant_capacity is None else tenant_capacity,
        ]  # fmt: skip
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
