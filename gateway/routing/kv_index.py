"""Which engine holds which prefix blocks, learned from their KV cache events.

Two keys per block. Engines name a block by their own hash (sha256-based, computed in the
engine); the gateway keys its index by a hash it computes itself from the block's tokens,
chained on its parent's key (`block_keys`), so that a prompt is looked up without knowing
the engine's hash function or seed. Each engine's map engine-hash -> our key is kept only
to apply removals, which arrive by engine hash.

Our key is Python's `hash()` of `(parent_key, *tokens)` (with the block's extra keys
after the parent when it has any). For ints and tuples of ints this is deterministic
across processes; strings in extra keys (LoRA names, cache salts) hash differently in
each process (PYTHONHASHSEED), so keys are only ever compared within one process, which
is all an index needs. ~0.15 µs a block of 16 tokens. A collision (1 in 2^64 a pair, or
a crafted prompt) costs one routing decision, never a wrong answer: the engine checks
its own hash.

Layout (~320 bytes a block held, ~2.4 µs a block of 16 tokens stored, evictions included;
tests/unit/gateway/test_kv_index.py prints both):
- `_lru`: (our key << 16 | source id) -> engine hash, in store order: eviction order
  across the index and each source's set of held keys at once;
- per source `by_hash`: engine hash -> our key, for removals;
- `_holders`: our key -> bitmask of the sources that hold it, for `match`.
A source is one engine's data-parallel rank: each rank has a cache (and a hash space) of
its own, while the gateway routes to the engine's URL, so `match` reports per URL the
best of its ranks.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wire.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000
DEFAULT_BLOCK_SIZE = 16
_SOURCE_BITS = 16
_SOURCE_MASK = (1 << _SOURCE_BITS) - 1
_ROOT = 0
"""The parent key of a prompt's first block (None is not used: its hash is per process
before Python 3.12, and 0 keeps keys ints)."""
GPU_MEDIA = (None, "GPU")
"""Blocks on other media (CPU, storage: an offloading tier) are not indexed: a hit there
costs a load, and a removal from one tier says nothing of the other."""

ExtraKeys = Sequence[Any] | None
"""One block's extra keys as vLLM publishes them (untagged: the LoRA name, `(mm id, offset)`
pairs, the cache salt, ...), None for a block of tokens only."""


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent_key: int | None = None,
    extra: Sequence[ExtraKeys] | None = None,
) -> list[int]:
    """Our key of each full block of `token_ids`, chained from `parent_key` (None: the
    prompt's start); `extra[i]`, when given, goes into block i's key."""
    parent = _ROOT if parent_key is None else parent_key
    keys: list[int] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = _key(parent, block, None if extra is None else extra[i])
        keys.append(parent)
    return keys


def _key(parent: int, block: Sequence[int], extra: ExtraKeys) -> int:
    if extra:
        return hash((parent, _frozen(extra), *block))
    return hash((parent, *block))


def _frozen(value: Any) -> Any:
    """Lists (msgpack arrays) as tuples, at any depth, so that they hash."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return value


def request_extra_keys(blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None) -> list[ExtraKeys]:
    """A text prompt's per-block extra keys as vLLM publishes them: the LoRA name in every
    block, the cache salt in the first only (multimodal inputs are not covered)."""
    extras: list[ExtraKeys] = []
    for i in range(blocks):
        keys = [name for name in (lora_name, cache_salt if i == 0 else None) if name]
        extras.append(tuple(keys) or None)
    return extras


@dataclass(eq=False)
class _Source:
    engine: str
    rank: int
    sid: int
    by_hash: dict[BlockHash, int] = field(default_factory=dict)
    stale: str | None = None

    @property
    def bit(self) -> int:
        return 1 << self.sid


class KVIndex:
    """Per process: which engines (pool URLs) hold which prefix blocks. Not thread-safe;
    every method is synchronous, so one event loop's tasks never see it half-updated."""

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        on_ignored: Callable[[str, str], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.ignored: Counter[str] = Counter()
        """Events (or parts) not indexed, by reason: `block_size`, `medium`, `group`,
        `shape`, `unknown_parent`."""
        self.evicted = 0
        self._on_ignored = on_ignored
        self._lru: OrderedDict[int, BlockHash] = OrderedDict()
        self._holders: dict[int, int] = {}
        self._sources: dict[tuple[str, int], _Source] = {}
        self._by_sid: dict[int, _Source] = {}

    # -- reading ------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Blocks held, counted once per engine rank that holds them."""
        return len(self._lru)

    def counts(self) -> dict[str, int]:
        """Blocks held per engine (its ranks summed)."""
        totals: dict[str, int] = {}
        for source in self._sources.values():
            totals[source.engine] = totals.get(source.engine, 0) + len(source.by_hash)
        return totals

    def is_stale(self, engine: str) -> bool:
        """True while events of some rank of `engine` were lost: its entries were cleared, so
        the index knows less than the engine holds (never more)."""
        return any(s.stale is not None for s in self._sources.values() if s.engine == engine)

    def stale_reason(self, engine: str) -> str | None:
        return next((s.stale for s in self._sources.values() if s.engine == engine and s.stale), None)

    def match(self, prompt_ids: Sequence[int], extra: Sequence[ExtraKeys] | None = None) -> dict[str, int]:
        """Per engine holding the prompt's first block: how many leading full blocks of the
        prompt it holds (the longest run from the start). The walk stops at the first block
        no engine holds, so a cold prompt costs one block's hash. Blocks are of the index's
        `block_size`; `extra` as for `block_keys` (see `request_extra_keys`)."""
        runs: dict[int, int] = {}
        active = -1
        parent = _ROOT
        size = self.block_size
        blocks = len(prompt_ids) // size
        for i in range(blocks):
            parent = _key(parent, prompt_ids[i * size : (i + 1) * size], None if extra is None else extra[i])
            holders = self._holders.get(parent, 0) & active
            if i > 0:
                self._ended(active & ~holders, i, runs)
            active = holders
            if not active:
                break
        else:
            self._ended(active if blocks else 0, blocks, runs)
        found: dict[str, int] = {}
        for sid, run in runs.items():
            engine = self._by_sid[sid].engine
            found[engine] = max(found.get(engine, 0), run)
        return found

    @staticmethod
    def _ended(mask: int, run: int, runs: dict[int, int]) -> None:
        while mask:
            low = mask & -mask
            runs[low.bit_length() - 1] = run
            mask ^= low

    # -- events -------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[Event], rank: int = 0) -> None:
        """One batch's events from rank `rank` of `engine`, in order."""
        source = self._source(engine, rank)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(source, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in GPU_MEDIA:
                    for block_hash in event.block_hashes:
                        self._drop(source, block_hash)
            elif isinstance(event, AllBlocksCleared):
                self._clear(source)
                source.stale = None  # the engine's cache is empty, and so is our view of it: exact again

    def clear(self, engine: str, rank: int | None = None) -> None:
        """Forget what `engine` holds (every rank, or one): it restarted, or events were lost."""
        for source in list(self._sources.values()):
            if source.engine == engine and (rank is None or source.rank == rank):
                self._clear(source)

    def mark_stale(self, engine: str, reason: str, rank: int = 0) -> None:
        self._source(engine, rank).stale = reason

    def mark_fresh(self, engine: str, rank: int = 0) -> None:
        """The index has seen this rank's whole run (a restart from seq 0): no longer stale."""
        self._source(engine, rank).stale = None

    def forget(self, engine: str) -> None:
        """`engine` left the pool: its entries and its sources go."""
        self.clear(engine)
        for key, source in list(self._sources.items()):
            if source.engine == engine:
                del self._sources[key]
                del self._by_sid[source.sid]

    def _source(self, engine: str, rank: int) -> _Source:
        source = self._sources.get((engine, rank))
        if source is None:
            sid = next(i for i in range(len(self._by_sid) + 1) if i not in self._by_sid)
            if sid > _SOURCE_MASK:
                raise ValueError(f"more than {_SOURCE_MASK + 1} engine ranks in one index")
            source = self._sources[(engine, rank)] = self._by_sid[sid] = _Source(engine, rank, sid)
        return source

    def _ignore(self, source: _Source, reason: str) -> None:
        self.ignored[reason] += 1
        if self._on_ignored is not None:
            self._on_ignored(source.engine, reason)

    def _stored(self, source: _Source, event: BlockStored) -> None:
        reason = self._unindexable(event)
        parent = None
        if reason is None and event.parent_block_hash is not None:
            parent = source.by_hash.get(event.parent_block_hash)
            reason = "unknown_parent" if parent is None else None  # a chain we cannot follow: never guessed
        if reason is not None:
            self._ignore(source, reason)
            return
        keys = block_keys(event.token_ids, self.block_size, parent, event.extra_keys)
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            self._store(source, block_hash, key)

    def _unindexable(self, event: BlockStored) -> str | None:
        if event.block_size != self.block_size:
            return "block_size"
        if event.medium not in GPU_MEDIA:
            return "medium"
        if event.group_idx not in (None, 0):
            return "group"  # a hybrid model's other KV cache groups
        count = len(event.block_hashes)
        extra = event.extra_keys
        if len(event.token_ids) != count * self.block_size or (extra is not None and len(extra) != count):
            return "shape"  # masked-out blocks (sliding window): no run of tokens to key them by
        return None

    def _store(self, source: _Source, block_hash: BlockHash, key: int) -> None:
        # Hot path, once per stored block. A re-stored block (vLLM reports prefix
        # cache hits as stores too) moves to the young end of the eviction order.
        slot = (key << _SOURCE_BITS) | source.sid
        held = self._lru.get(slot)
        if held is not None:
            self._lru.move_to_end(slot)
            if held != block_hash:
                del source.by_hash[held]
                self._lru[slot] = block_hash
                source.by_hash[block_hash] = key
            return
        previous = source.by_hash.get(block_hash)
        if previous is not None:
            self._drop(source, block_hash)  # the engine's hash now names other tokens (by our key)
        self._lru[slot] = block_hash
        source.by_hash[block_hash] = key
        self._holders[key] = self._holders.get(key, 0) | source.bit
        if len(self._lru) > self.max_blocks:
            self._evict()

    def _evict(self) -> None:
        slot, block_hash = self._lru.popitem(last=False)
        source = self._by_sid[slot & _SOURCE_MASK]
        del source.by_hash[block_hash]
        self._unhold(slot >> _SOURCE_BITS, source.bit)
        self.evicted += 1

    def _drop(self, source: _Source, block_hash: BlockHash) -> None:
        key = source.by_hash.pop(block_hash, None)
        if key is None:
            return  # stored before we subscribed, skipped, or evicted: nothing to undo
        del self._lru[(key << _SOURCE_BITS) | source.sid]
        self._unhold(key, source.bit)

    def _unhold(self, key: int, bit: int) -> None:
        holders = self._holders[key] & ~bit
        if holders:
            self._holders[key] = holders
        else:
            del self._holders[key]

    def _clear(self, source: _Source) -> None:
        for block_hash in list(source.by_hash):
            self._drop(source, block_hash)
