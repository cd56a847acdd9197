"""Where finished Responses are kept, scoped to their owner and bounded per owner and in all.

A stored response belongs to the caller that created it (`gateway.edge.auth.Caller.owner`: an API
key's tenant, the key itself when it names none, or the one anonymous owner with auth off).
Another owner's id is answered exactly as an unknown one, so ids say nothing across tenants.

Entries are held as their encoded JSON (the response, and the chat conversation it ended)
and counted as the bytes they occupy: the JSON plus `ENTRY_OVERHEAD` for the objects around
it. Held as Python objects instead, a response with logprobs takes several times its JSON.
Past an owner's share (`max_tenant_*`) that owner's least recently used go first; past the
whole store's bound (`max_*`), the least recently used of anyone's.

`ResponseStore` is one process's; `gateway.apis.shared_responses` keeps the same over an SQLite
file that `--workers N` share, `gateway.apis.redis_responses` in a Redis server that replicas
share (`state: {backend: redis}`). Requests reach each through the async `ResponseStorage`.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

import msgspec

from wire.openai_schema import ChatMessageParam
from gateway.config import ResponseStoreConfig
from gateway.edge.errors import StateUnavailable

T = TypeVar("T")

ENTRY_OVERHEAD = 400
"""Bytes an entry takes besides its JSON, in CPython 3.11: its id, two bytes objects' headers,
the entry and its places in two ordered dicts, measured at about 250 with tracemalloc (the
rest is room for the dicts' growth steps; tests/unit/gateway/test_response_store.py)."""

_encode = msgspec.json.Encoder().encode
_CONVERSATION = msgspec.json.Decoder(list[ChatMessageParam])


def _exact(data: bytes) -> bytes:
    """A copy that takes only its length: msgspec hands back its encoding buffer, which
    holds up to ~40% more than the JSON in it."""
    return bytes(memoryview(data))


def entry_size(body: bytes, conversation: bytes, session: str | None = None) -> int:
    """What one entry counts against the bounds."""
    return len(body) + len(conversation) + len(session or "") + ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: msgspec.Raw
    """What `GET /v1/responses/{id}` answers: the response's JSON."""
    conversation: list[ChatMessageParam]
    """The chat messages the response ended, its answer last: a later turn's history."""
    session: str | None = None
    """The conversation's session key (`gateway.flow.session`), which a continuation keeps."""


class ResponseStorage(Protocol):
    """Where finished responses are kept, as requests reach it: `InProcess` (over `ResponseStore`,
    or the SQLite file workers share) or `RedisResponseStore`. A store that cannot answer in
    `state.timeout_s` raises `gateway.edge.errors.StateUnavailable`."""

    async def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool:
        """`response`: the encoded Response. False when the entry alone is over the owner's
        share: it is not kept."""
        ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """None when there is none by that id, or it is another owner's."""
        ...

    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class SyncStorage(Protocol):
    """A store whose operations return at once (`ResponseStore`) or block (the SQLite file)."""

    def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool: ...

    def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    def delete(self, owner: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


class InProcess:
    """A synchronous store as `ResponseStorage`: called in place when it never blocks (this
    process's memory), else on a thread of its own, one call at a time, bounded by `timeout_s`
    (the SQLite file: its lock may be held by another worker)."""

    def __init__(self, store: SyncStorage, timeout_s: float | None = None) -> None:
        self.store = store
        self._timeout_s = timeout_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="response-store") if timeout_s is not None else None

    async def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool:
        return await self._call(partial(self.store.put, owner, response_id, response, conversation, session))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self._call(partial(self.store.get, owner, response_id))

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._call(partial(self.store.delete, owner, response_id))

    async def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.store.close()

    async def _call(self, operation: Callable[[], T]) -> T:
        if self._thread is None:
            return operation()
        done = asyncio.get_running_loop().run_in_executor(self._thread, operation)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await done
        except TimeoutError:
            raise StateUnavailable(
                f"the Responses store did not answer in state.timeout_s={self._timeout_s}s; retry later"
            ) from None
        except sqlite3.Error as exc:
            raise StateUnavailable(f"the Responses store failed: {exc}; retry later") from exc


@dataclass(slots=True)
class _Entry:
    owner: str
    body: bytes
    conversation: bytes
    size: int
    session: str | None


@dataclass(slots=True)
class _Share:
    """One owner's entries, least recently used first, and the bytes they count."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0


class ResponseStore:
    """This process's finished responses; O(1) a put, get or eviction, one encode per put and
    one decode per get of the conversation."""

    def __init__(self, bounds: ResponseStoreConfig | None = None) -> None:
        self.bounds = bounds or ResponseStoreConfig()
        self.bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # everyone's, least recently used first
        self._shares: dict[str, _Share] = {}  # only owners with an entry: bounded as entries are

    def __len__(self) -> int:
        return len(self._entries)

    def owner_bytes(self, owner: str) -> int:
        share = self._shares.get(owner)
        return share.bytes if share is not None else 0

    def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool:
        history = _encode(conversation)
        size = entry_size(response, history, session)
        self._drop(response_id)
        if size > self.bounds.max_tenant_bytes:
            return False
        self._entries[response_id] = _Entry(owner, _exact(response), _exact(history), size, session)
        share = self._shares.get(owner)
        if share is None:
            share = self._shares[owner] = _Share()
        share.ids[response_id] = None
        share.bytes += size
        self.bytes += size
        # The new entry fits its owner's share alone, so neither loop reaches it.
        while len(share.ids) > self.bounds.max_tenant_entries or share.bytes > self.bounds.max_tenant_bytes:
            self._drop(next(iter(share.ids)))
        while len(self._entries) > self.bounds.max_entries or self.bytes > self.bounds.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None  # another owner's entry is not touched: its place in the order stays
        self._entries.move_to_end(response_id)
        self._shares[owner].ids.move_to_end(response_id)
        return StoredResponse(msgspec.Raw(entry.body), _CONVERSATION.decode(entry.conversation), entry.session)

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._drop(response_id)
        return True

    def close(self) -> None:
        """Nothing to release: what it holds goes with the process."""

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.bytes -= entry.size
        share = self._shares[entry.owner]
        del share.ids[response_id]
        share.bytes -= entry.size
        if not share.ids:
            del self._shares[entry.owner]
