"""Tenant quota buckets in the Redis server every worker and replica shares
(`state: {backend: redis}`): the limits hold for all of them together.

Each operation is one Lua script over all of the tenant's buckets, so a reserve is all or
nothing and no two gateways ever read, then write, the same bucket. Time is the server's
(`TIME`), so replicas whose clocks differ still refill a bucket alike. Keys (under
`state.key_prefix`, the tenant percent-encoded):

    q:<tenant>:<limit>    hash: l (the level), t (when, in server milliseconds); it expires
                          once the bucket would be full again (a missing bucket is full)
    q:r:<reservation>     hash: <limit> → tokens reserved; deleted by the settle, or expires
                          after `RESERVATION_TTL_S` (a gateway that died before settling:
                          the reservation stays charged, as if fully used)

Every call is bounded by `state.timeout_s`; a server down, slow or refusing raises
`StateUnavailable`, which the caller turns into `state.quota_on_failure`'s answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.apis.redis_responses import owner_key
from gateway.config import StateConfig
from gateway.edge.quota import Decision, Level, Limit
from gateway.redis_state import RedisState

RESERVATION_TTL_S = 86_400
"""Longer than any request (streams included) is expected to last."""

# Shared by both scripts: the server's clock in ms, and a bucket's level now.
_LEVEL = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function level(key, cap, window)
    local got = redis.call('HMGET', key, 'l', 't')
    if not got[1] then return cap end
    return math.min(cap, tonumber(got[1]) + math.max(0, now - tonumber(got[2])) * cap / window)
end
local function keep(key, value, cap, window)
    redis.call('HSET', key, 'l', string.format('%.17g', value), 't', string.format('%.0f', now))
    redis.call('PEXPIRE', key, math.ceil((cap - value) * window / cap) + 1000)
end
"""

_LIMITS = """
-- ARGV[3]: each limit as `name capacity window_ms counts_tokens(1/0)`, one after another.
local limits = {}
for name, cap, window, tokens in string.gmatch(ARGV[3], '(%S+) (%S+) (%S+) (%S+)') do
    limits[#limits + 1] = {name = name, cap = tonumber(cap), window = tonumber(window), tokens = tokens == '1'}
end
"""

_RESERVE = (
    _LEVEL
    + _LIMITS
    + """
-- KEYS: the reservation, then one bucket per limit. ARGV: reservation ttl (ms), the request's tokens, the limits.
-- Returns {admitted, refusing limit's index, wait (ms), then per limit: level after, ms to full}.
local asked = tonumber(ARGV[2])
local levels, wanted, worst, wait = {}, {}, 0, 0
for i, limit in ipairs(limits) do
    wanted[i] = 1
    if limit.tokens then wanted[i] = math.min(asked, limit.cap) end
    levels[i] = level(KEYS[i + 1], limit.cap, limit.window)
    if levels[i] < wanted[i] then
        local needs = (wanted[i] - levels[i]) * limit.window / limit.cap
        if needs > wait then wait, worst = needs, i end
    end
end
local admitted = 0
if worst == 0 then
    admitted = 1
    for i, limit in ipairs(limits) do
        levels[i] = levels[i] - wanted[i]
        keep(KEYS[i + 1], levels[i], limit.cap, limit.window)
        if limit.tokens then redis.call('HSET', KEYS[1], limit.name, wanted[i]) end
    end
    if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
end
local out = {admitted, worst, math.ceil(wait)}
for i, limit in ipairs(limits) do
    out[#out + 1] = math.max(0, math.floor(levels[i]))
    out[#out + 1] = math.ceil(math.max(0, limit.cap - levels[i]) * limit.window / limit.cap)
end
return out
"""
)

_SETTLE = (
    _LEVEL
    + _LIMITS
    + """
-- KEYS: the reservation, then one bucket per limit. ARGV: the tokens used, unused, the limits.
-- Returns 1, or 0 when settled before (nothing changes).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local used = tonumber(ARGV[1])
for i, limit in ipairs(limits) do
    local reserved = redis.call('HGET', KEYS[1], limit.name)
    if limit.tokens and reserved then
        local now_level = level(KEYS[i + 1], limit.cap, limit.window)
        keep(KEYS[i + 1], math.min(limit.cap, now_level - (used - tonumber(reserved))), limit.cap, limit.window)
    end
end
redis.call('DEL', KEYS[1])
return 1
"""
)


class RedisQuotas:
    """`QuotaStore` over one Redis server, shared by every gateway that names it."""

    def __init__(self, state: StateConfig) -> None:
        self.state = RedisState(state, "the quota store")
        self.redis = self.state.redis
        self.prefix = state.key_prefix
        self._reserve = self.redis.register_script(_RESERVE)
        self._settle = self.redis.register_script(_SETTLE)
        self._specs: dict[tuple[Limit, ...], str] = {}

    def bucket_key(self, tenant: str, limit: Limit) -> str:
        return f"{self.prefix}q:{owner_key(tenant)}:{limit.name}"

    def reservation_key(self, reservation: str) -> str:
        return f"{self.prefix}q:r:{reservation}"

    def _keys(self, tenant: str, reservation: str, limits: Sequence[Limit]) -> list[str]:
        return [self.reservation_key(reservation), *(self.bucket_key(tenant, limit) for limit in limits)]

    def _spec(self, limits: Sequence[Limit]) -> str:
        """The limits as one argument: each argument costs the client's encoder (measured, ~3 µs)."""
        key = tuple(limits)
        found = self._specs.get(key)
        if found is None:
            found = self._specs[key] = " ".join(
                f"{limit.name} {limit.capacity} {int(limit.window_s * 1000)} {int(limit.tokens)}" for limit in limits
            )
        return found

    async def reserve(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int) -> Decision:
        args = [RESERVATION_TTL_S * 1000, tokens, self._spec(limits)]
        answer = await self.state.serve(self._reserve(keys=self._keys(tenant, reservation, limits), args=args))
        admitted, worst, wait_ms, *rest = (int(value) for value in answer)
        levels = tuple(Level(limit, rest[2 * i], rest[2 * i + 1] / 1000) for i, limit in enumerate(limits))
        if admitted:
            return Decision(True, levels)
        return Decision(False, levels, wait_ms / 1000, limits[worst - 1].name)

    async def settle(self, tenant: str, reservation: str, limits: Sequence[Limit], tokens: int | None) -> bool:
        if tokens is None:  # what it reserved stands: only the reservation goes
            return bool(await self.state.serve(self.redis.delete(self.reservation_key(reservation))))
        args = [tokens, 0, self._spec(limits)]
        return bool(await self.state.serve(self._settle(keys=self._keys(tenant, reservation, limits), args=args)))

    async def close(self) -> None:
        await self.state.close()

