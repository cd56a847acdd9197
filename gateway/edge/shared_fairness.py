"""Fair queueing's counters shared by every worker and replica (`state.backend: redis`), so
that a tenant served a lot through one process stands behind a tenant served little through
another.

Each process charges the tokens it serves, per unit of its tenant's weight, to the tenant's
bucket here, in memory: no admission waits on Redis. Every `state.fairness_sync_s` one Lua
script pushes what was charged since the last round (HINCRBYFLOAT into one hash), decays the
hash and returns it whole. Two figures come out of it:

- `rank(tenant)`: the tokens its bucket was served recently, everywhere (the hash, with this
  process's charges not yet pushed added). Leases (`gateway.edge.shared_slots`) go by it across
  processes: a request does not take a free slot while a request of a bucket with a lower
  rank (or of a more urgent priority) waits for one in another process.
- `elsewhere(tenant)`: what its bucket was served recently by the other processes (the hash
  less this process's own pushes, decayed alike). The local queue (`gateway.edge.admission`)
  orders a tenant's requests as if their start in virtual time were that much later, so its
  order counts what the tenant was served through the other processes too; a process alone
  orders exactly as without sharing.

"Recently": the hash decays with a half-life of `HALF_LIFE_S` (a tenant that was idle keeps
little credit, as the local queue's tenant back from idle starts at its virtual time). It is
bounded by the configured tenants' names and `"*"` (every other tenant, and the requests
without one), and expires `KEEP_S` after the last round, so a deployment that is gone leaves
nothing. With the server down or slow (`state.timeout_s`), a round is skipped: its charges are
dropped rather than risk counting them twice, and each process orders by its own counters
until the server answers (fail open, like the leases).

Keys (under `state.key_prefix`):

    fair:served   hash: bucket → its tokens served per unit of weight, decayed
    fair:at       the server's time (ms) the hash was last decayed to
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from gateway.config import StateConfig
from gateway.redis_state import RedisState, StateDown

HALF_LIFE_S = 10.0
"""How fast a bucket's served tokens are forgotten: halved every this many seconds."""
KEEP_S = 6 * HALF_LIFE_S
"""The keys expire this long after the last round (what is left is 1/64 of it by then)."""
OTHERS = "*"
"""The bucket of every tenant without a `tenants:` entry of its own, and of requests without one."""
FORGOTTEN = 1e-3
"""A bucket decayed below this many tokens per weight leaves the hash."""

_SYNC = """
-- ARGV: prefix, half-life ms, keep ms, then pairs of (bucket, tokens per weight to add)
local p, half, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local served, at = p .. 'fair:served', p .. 'fair:at'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = tonumber(redis.call('GET', at) or now)
if now > last then
    local factor = math.pow(0.5, (now - last) / half)
    local fields = redis.call('HGETALL', served)
    for i = 1, #fields, 2 do
        local v = tonumber(fields[i + 1]) * factor
        if v < FORGOTTEN then
            redis.call('HDEL', served, fields[i])
        else
            redis.call('HSET', served, fields[i], string.format('%.17g', v))
        end
    end
end
for i = 4, #ARGV, 2 do
    if tonumber(redis.call('HINCRBYFLOAT', served, ARGV[i], ARGV[i + 1])) < 0 then
        redis.call('HSET', served, ARGV[i], '0')  -- a correction larger than what decay left
    end
end
redis.call('SET', at, now, 'PX', keep)
redis.call('PEXPIRE', served, keep)
return {now, redis.call('HGETALL', served)}
""".replace("FORGOTTEN", repr(FORGOTTEN))


class SharedFairness:
    """This process's view of the served-tokens hash, and its charges not yet pushed."""

    def __init__(
        self,
        state: StateConfig,
        named: Iterable[str],
        on_down: Callable[[], None] | None = None,
        half_life_s: float = HALF_LIFE_S,
    ) -> None:
        """`named`: the configured tenants (a bucket each); `on_down`: called for each round
        the server did not answer."""
        assert state.fairness_sync_s is not None  # None: per-process counters, no instance
        self.state = RedisState(state, "admission's shared fairness counters (local counters only meanwhile)")
        self.prefix = state.key_prefix
        self.sync_s = state.fairness_sync_s
        self.half_ms = half_life_s * 1000
        self._named = frozenset(named) - {OTHERS}
        self._on_down = on_down
        self._script = self.state.redis.register_script(_SYNC)
        self.served: dict[str, float] = {}
        """Each bucket's tokens per weight, decayed, as the hash was at the last round."""
        self._mine: dict[str, float] = {}
        """What this process pushed, decayed as the hash is: the part of `served` that is its own."""
        self._pending: dict[str, float] = {}
        self._pushing: dict[str, float] = {}
        self._server_ms: int | None = None

    def bucket(self, tenant: str | None) -> str:
        return tenant if tenant is not None and tenant in self._named else OTHERS

    def charge(self, tenant: str | None, tokens_per_weight: float) -> None:
        """Served (or corrected, when negative) here: pushed with the next round."""
        bucket = self.bucket(tenant)
        self._pending[bucket] = self._pending.get(bucket, 0.0) + tokens_per_weight

    def rank(self, tenant: str | None) -> float:
        """The bucket's tokens per weight served recently, everywhere, as this process knows now."""
        bucket = self.bucket(tenant)
        return self.served.get(bucket, 0.0) + self._pushing.get(bucket, 0.0) + self._pending.get(bucket, 0.0)

    def elsewhere(self, tenant: str | None) -> float:
        """The bucket's tokens per weight served recently by the other processes."""
        bucket = self.bucket(tenant)
        return max(self.served.get(bucket, 0.0) - self._mine.get(bucket, 0.0), 0.0)

    async def run(self) -> None:
        """A round every `sync_s`, forever (a background loop)."""
        while True:
            await asyncio.sleep(self.sync_s)
            await self.sync()

    async def sync(self) -> None:
        """One round: push this process's charges, decay the hash, pull it whole."""
        self._pushing, self._pending = self._pending, {}
        args: list[str | float] = [self.prefix, self.half_ms, KEEP_S * 1000]
        args += [part for bucket, tokens in self._pushing.items() for part in (bucket, repr(tokens))]
        try:
            now_ms, flat = await self.state.call(self._script(args=args))
        except StateDown:
            if self._on_down is not None:
                self._on_down()
            return
        finally:
            pushed, self._pushing = self._pushing, {}
        self.served = {bytes(flat[i]).decode(): float(flat[i + 1]) for i in range(0, len(flat), 2)}
        self._count_mine(pushed, int(now_ms))

    def _count_mine(self, pushed: dict[str, float], now_ms: int) -> None:
        """Decay this process's own part by the server's time since the last round, as the
        hash was (decays compose), and add what it just pushed."""
        since = 0 if self._server_ms is None else max(now_ms - self._server_ms, 0)
        factor = 0.5 ** (since / self.half_ms)
        mine = {bucket: value * factor for bucket, value in self._mine.items()}
        for bucket, tokens in pushed.items():
            mine[bucket] = mine.get(bucket, 0.0) + tokens
        self._mine = {bucket: value for bucket, value in mine.items() if bucket in self.served}
        self._server_ms = now_ms

    async def close(self) -> None:
        await self.state.close()
