"""The Responses store in a Redis server that every replica and worker shares
(`state: {backend: redis, url: ...}`): a response stored through one gateway is continued and
fetched through any other.

Scoped and bounded as the in-process store is (`gateway.apis.response_store`): an entry's key
names its owner (`<prefix>r:<owner>:<id>`, the owner percent-encoded so that it holds no `:`),
so one owner's request cannot address another's entry at all; each owner's share, then the
whole store, is bounded in entries and bytes (sizes counted as `entry_size` counts them), the
least recently used evicted first. Recency is a sorted set per owner and one for everyone,
scored by a counter; every change is one Lua script, so the bounds hold across processes.

Keys (all under `state.key_prefix`):

    r:<owner>:<id>   hash: b (the response's JSON), c (the conversation's), s (the session)
    lru              sorted set of <owner>:<id>, by last use
    lru:<owner>      sorted set of <id>, by last use
    sizes            hash <owner>:<id> → the entry's size
    owner_bytes      hash <owner> → the bytes of its entries
    bytes            the bytes of everyone's
    tick             the recency counter

One server, not a cluster: a script touches keys it finds as it evicts. Every call is bounded by
`state.timeout_s`; a server that is down, slow or refusing raises `StateUnavailable` (a 503 for
the request that needed the store), and the client reconnects by itself when it is back.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import msgspec

from gateway.apis.response_store import StoredResponse, entry_size
from gateway.config import ResponseStoreConfig, StateConfig
from gateway.redis_state import RedisState
from wire.openai_schema import ChatMessageParam

_encode = msgspec.json.Encoder().encode
_CONVERSATION = msgspec.json.Decoder(list[ChatMessageParam])

# Shared by the scripts: drop one entry and what counts it.
_DROP = """
local p = ARGV[1]
local function drop(owner, rid)
    local member = owner .. ':' .. rid
    local size = tonumber(redis.call('HGET', p .. 'sizes', member))
    if not size then return false end
    redis.call('HDEL', p .. 'sizes', member)
    redis.call('DEL', p .. 'r:' .. member)
    redis.call('ZREM', p .. 'lru', member)
    redis.call('ZREM', p .. 'lru:' .. owner, rid)
    redis.call('DECRBY', p .. 'bytes', size)
    if redis.call('HINCRBY', p .. 'owner_bytes', owner, -size) <= 0 then
        redis.call('HDEL', p .. 'owner_bytes', owner)
    end
    return true
end
"""

_PUT = (
    _DROP
    + """
-- ARGV: prefix, owner, id, body, conversation, session, has session, size,
--       max_tenant_entries, max_tenant_bytes, max_entries, max_bytes
local owner, rid = ARGV[2], ARGV[3]
drop(owner, rid)
local size = tonumber(ARGV[8])
if size > tonumber(ARGV[10]) then return 0 end
local member = owner .. ':' .. rid
local tick = redis.call('INCR', p .. 'tick')
redis.call('HSET', p .. 'r:' .. member, 'b', ARGV[4], 'c', ARGV[5])
if ARGV[7] == '1' then redis.call('HSET', p .. 'r:' .. member, 's', ARGV[6]) end
redis.call('HSET', p .. 'sizes', member, size)
redis.call('ZADD', p .. 'lru', tick, member)
redis.call('ZADD', p .. 'lru:' .. owner, tick, rid)
redis.call('INCRBY', p .. 'bytes', size)
redis.call('HINCRBY', p .. 'owner_bytes', owner, size)
-- The new entry fits its owner's share alone (and so the whole), so neither loop reaches it.
local mine = p .. 'lru:' .. owner
while redis.call('ZCARD', mine) > tonumber(ARGV[9])
    or tonumber(redis.call('HGET', p .. 'owner_bytes', owner) or '0') > tonumber(ARGV[10]) do
    drop(owner, redis.call('ZRANGE', mine, 0, 0)[1])
end
while redis.call('ZCARD', p .. 'lru') > tonumber(ARGV[11])
    or tonumber(redis.call('GET', p .. 'bytes') or '0') > tonumber(ARGV[12]) do
    local oldest = redis.call('ZRANGE', p .. 'lru', 0, 0)[1]
    local sep = string.find(oldest, ':', 1, true)
    drop(string.sub(oldest, 1, sep - 1), string.sub(oldest, sep + 1))
end
return 1
"""
)

_GET = """
-- ARGV: prefix, owner, id. Another owner's entry is not touched: its place in the order stays.
local p, owner, rid = ARGV[1], ARGV[2], ARGV[3]
local member = owner .. ':' .. rid
local entry = redis.call('HMGET', p .. 'r:' .. member, 'b', 'c', 's')
if not entry[1] then return false end
local tick = redis.call('INCR', p .. 'tick')
redis.call('ZADD', p .. 'lru', tick, member)
redis.call('ZADD', p .. 'lru:' .. owner, tick, rid)
return entry
"""

_DELETE = (
    _DROP
    + """
-- ARGV: prefix, owner, id
if drop(ARGV[2], ARGV[3]) then return 1 end
return 0
"""
)


def owner_key(owner: str) -> str:
    """The owner as it appears in keys: percent-encoded, so it holds no `:` and two owners
    never share a key."""
    return quote(owner, safe="")


class RedisResponseStore:
    """`ResponseStorage` over one Redis server, shared by every gateway that names it."""

    def __init__(self, state: StateConfig, bounds: ResponseStoreConfig | None = None) -> None:
        self.bounds = bounds or ResponseStoreConfig()
        self.state = RedisState(state, "the Responses store")
        self.redis = self.state.redis
        self.prefix = state.key_prefix
        self._put = self.redis.register_script(_PUT)
        self._get = self.redis.register_script(_GET)
        self._delete = self.redis.register_script(_DELETE)

    async def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool:
        history = _encode(conversation)
        size = entry_size(response, history, session)
        if size > self.bounds.max_tenant_bytes:  # refused without a round trip; an older one goes
            await self.delete(owner, response_id)
            return False
        bounds = self.bounds
        kept_session = [session or "", "1" if session is not None else "0"]
        args = [
            self.prefix, owner_key(owner), response_id, response, history, *kept_session,
            size, bounds.max_tenant_entries, bounds.max_tenant_bytes, bounds.max_entries, bounds.max_bytes,
        ]  # fmt: skip
        return bool(await self.state.serve(self._put(args=args)))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = await self.state.serve(self._get(args=[self.prefix, owner_key(owner), response_id]))
        if entry is None:
            return None
        body, history, session = entry
        return StoredResponse(msgspec.Raw(body), _CONVERSATION.decode(history), _text(session))

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await self.state.serve(self._delete(args=[self.prefix, owner_key(owner), response_id])))

    async def close(self) -> None:
        await self.state.close()


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
