"""Which engine holds which prefix blocks, learned from their KV cache events.

Two keys per block. Engines name a block by their own hash (sha256-based, computed in the
engine); the gateway keys its index by a hash it computes itself from the block's tokens,
chained on its parent's key (`block_keys`), so that a prompt is looked up without knowing
the engine's hash function or seed. Each engine's map engine-hash -> our key is kept only
to apply removals, which arrive by engine hash.

Our key is Python's `hash()` of `(parent_key, tokens)`, `tokens` the block's ids as
4-byte unsigned ints (`array('I')` bytes: a rendered prompt is held that way, so a
140K-token prompt is keyed in ~1.4 ms, where a tuple of its ints as Python objects took
~2.7 ms and the list ~2 ms more to make), with the block's extra keys after the parent
when it has any. Strings and bytes hash differently in each process (PYTHONHASHSEED), so
keys are only ever compared within one process, which is all an index needs. A
collision (1 in 2^64 a pair, or a crafted prompt) costs one routing decision, never a
wrong answer: the engine checks its own hash.

Layout (~360 bytes a block held; tests/unit/gateway/test_kv_index.py prints it and the CPU
a block stored, scripts/bench_kv_subscriber.py the CPU in a listening gateway):
- `_slots`: store sequence number -> (our key << 16 | source id), and `_hashes`: store
  sequence number -> engine hash, both in store order: the eviction order;
- `_live`: sequence number >> 6 -> bitmask of the 64 numbers of that run still held, so
  that the eviction steps past removed blocks without looking each up;
- per source `by_hash`: engine hash -> store sequence number, for removals;
- `_holders`: our key -> bitmask of the sources that hold it, for `match` (and whether a
  source holds a key already).

Every map holds only ints (or an engine's bytes hashes), so none is tracked by the cyclic
GC: a collection of the oldest generation does not walk the index (an `OrderedDict` of a
million blocks cost ~80 ms a collection, a pause of every stream in the process). What a
block costs a listening gateway is mostly what it touches at random in the index's few
hundred MB, caches cold (batches arrive while the process slept): a store looks up two maps
at random (`_holders`, `by_hash`) and appends to those by sequence number, a removal looks
up each. The budget is applied after each batch, not each store: an engine at capacity
publishes its stores with the removals that made room for them.

A source is one engine's data-parallel rank: each rank has a cache (and a hash space) of
its own, while the gateway routes to the engine's URL, so `match` reports per URL the
best of its ranks.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wire.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000
DEFAULT_BLOCK_SIZE = 16
_SOURCE_BITS = 16
_SOURCE_MASK = (1 << _SOURCE_BITS) - 1
_RUN_BITS = 6
_RUN_MASK = (1 << _RUN_BITS) - 1
_RUN_STEPS = 64
"""Runs of 64 sequence numbers the eviction steps over before it looks the lowest up (`KVIndex._first`)."""
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
    prompt's start); `extra[i]`, when given, goes into block i's key. None fit ids that are
    no token (negative, or past 4 bytes): no engine holds such a block."""
    raw = token_bytes(token_ids)
    if raw is None:
        return []
    parent = _ROOT if parent_key is None else parent_key
    step = 4 * block_size
    keys: list[int] = []
    for i in range(len(token_ids) // block_size):
        parent = _key(parent, raw[i * step : (i + 1) * step], None if extra is None else extra[i])
        keys.append(parent)
    return keys


def token_bytes(token_ids: Sequence[int]) -> bytes | None:
    """The ids as 4-byte unsigned ints, what keys hash; None if one does not fit (no token does not)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()  # a rendered prompt (`TokenIds`): a copy, no int made
    try:
        return array("I", token_ids).tobytes()
    except OverflowError:
        return None


def _key(parent: int, block: bytes, extra: ExtraKeys) -> int:
    if extra:
        return hash((parent, _frozen(extra), block))
    return hash((parent, block))


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
    """Engine hash -> the block's store sequence number."""
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
        `shape`, `unknown_parent`, `duplicate` (a block the engine rank holds already
        under another engine hash)."""
        self.evicted = 0
        self._on_ignored = on_ignored
        self._slots: dict[int, int] = {}
        self._hashes: dict[int, BlockHash] = {}
        self._next = 0
        """The next store sequence number."""
        self._live: dict[int, int] = {}
        """Sequence number >> 6 -> bitmask of those of the run of 64 held: the eviction finds
        the oldest held past numbers gone without looking each up (an absent key's lookup
        in a map this churned probes several slots at random); a small map, runs in order."""
        self._oldest = 0
        """No block held has a sequence number below it (the eviction's cursor)."""
        self._holders: dict[int, int] = {}
        self._sources: dict[tuple[str, int], _Source] = {}
        self._by_sid: dict[int, _Source] = {}
        self._catch_ups: list[Callable[[], None]] = []

    # -- reading ------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Blocks held, counted once per engine rank that holds them."""
        return len(self._slots)

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
        `block_size`; `extra` as for `block_keys` (see `request_extra_keys`). What the
        subscriptions have received is applied first (`add_catch_up`)."""
        for catch_up in self._catch_ups:
            catch_up()
        runs: dict[int, int] = {}
        active = -1
        parent = _ROOT
        step = 4 * self.block_size
        raw = token_bytes(prompt_ids) or b""  # ids no token has: no engine holds a block of them
        blocks = len(raw) // step
        for i in range(blocks):
            parent = _key(parent, raw[i * step : (i + 1) * step], None if extra is None else extra[i])
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

    def add_catch_up(self, catch_up: Callable[[], None]) -> None:
        """Call `catch_up` before each match: a subscription that applies its events in
        batches now and then (cheaper than a wake-up each) applies what it has received, so
        that a routing decision sees it."""
        self._catch_ups.append(catch_up)

    def remove_catch_up(self, catch_up: Callable[[], None]) -> None:
        if catch_up in self._catch_ups:
            self._catch_ups.remove(catch_up)

    @staticmethod
    def _ended(mask: int, run: int, runs: dict[int, int]) -> None:
        while mask:
            low = mask & -mask
            runs[low.bit_length() - 1] = run
            mask ^= low

    # -- events -------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[Event], rank: int = 0) -> None:
        """One batch's events from rank `rank` of `engine`, in order; then, past the budget,
        the least recently stored blocks are forgotten (after the batch, not each store: an
        engine's batch removes what it evicted for its stores, most often keeping the index
        within the budget without evicting what the engine still holds)."""
        source = self._source(engine, rank)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(source, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in GPU_MEDIA:
                    self._removed(source, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(source)
                source.stale = None  # the engine's cache is empty, and so is our view of it: exact again
        while len(self._slots) > self.max_blocks:
            self._evict()

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
            seq = source.by_hash.get(event.parent_block_hash)
            parent = None if seq is None else self._slots[seq] >> _SOURCE_BITS
            reason = "unknown_parent" if parent is None else None  # a chain we cannot follow: never guessed
        raw = token_bytes(event.token_ids) if reason is None else None
        if reason is None and raw is None:
            reason = "token_ids"  # an id no token has (negative, or past 4 bytes)
        if reason is not None:
            self._ignore(source, reason)
            return
        assert raw is not None
        self._chain(source, event.block_hashes, raw, parent, event.extra_keys)

    def _chain(
        self, source: _Source, hashes: Sequence[BlockHash], raw: bytes, parent: int | None,
        extra: Sequence[ExtraKeys] | None,
    ) -> None:
        """Store a chain of blocks: `block_keys` and each block's store in one loop, the
        common case (a block this rank did not hold) inline. Hot path: once per block any
        engine computes."""
        slots, hashes_at, holders, by_hash = self._slots, self._hashes, self._holders, source.by_hash
        sid, bit, size = source.sid, source.bit, 4 * self.block_size  # bytes of a block's ids
        key = _ROOT if parent is None else parent
        seq = first = self._next  # [first, seq): stored by this loop, not yet in `_live`
        start = 0
        for i, block_hash in enumerate(hashes):
            end = start + size
            extra_keys = None if extra is None else extra[i]
            block = raw[start:end]
            key = hash((key, _frozen(extra_keys), block)) if extra_keys else hash((key, block))
            start = end
            holding = holders.get(key, 0)
            if holding & bit:
                self._mark_live(first, seq)
                self._next = seq
                self._restored(source, block_hash, key)
                seq = first = self._next
                continue
            previous = by_hash.setdefault(block_hash, seq)
            if previous != seq:  # the engine's hash now names other tokens (by our key)
                self._mark_live(first, seq)
                first = seq
                self._drop(source, block_hash)
                by_hash[block_hash] = seq
            slots[seq] = (key << _SOURCE_BITS) | sid
            hashes_at[seq] = block_hash
            holders[key] = holding | bit
            seq += 1
        self._mark_live(first, seq)
        self._next = seq

    def _mark_live(self, low: int, high: int) -> None:
        """Sequence numbers `low` to `high - 1` held (`_live`), a run of 64 at a time."""
        live = self._live
        while low < high:
            run = low >> _RUN_BITS
            end = min(high, (run + 1) << _RUN_BITS)
            live[run] = live.get(run, 0) | (((1 << (end - low)) - 1) << (low & _RUN_MASK))
            low = end

    def _restored(self, source: _Source, block_hash: BlockHash, key: int) -> None:
        """A block this rank holds already (vLLM reports some cache hits as stores too): the
        youngest now. Held under another engine hash (our keys collided, or the engine hashes
        something its events do not carry), the new hash is not indexed: a removal by either
        then costs at most a missed affinity."""
        slot = (key << _SOURCE_BITS) | source.sid
        seq = source.by_hash.get(block_hash)
        if seq is None or self._slots.get(seq) != slot:
            self._ignore(source, "duplicate")
            return
        del self._slots[seq], self._hashes[seq]
        self._release(seq)
        young = self._next
        self._next = young + 1
        source.by_hash[block_hash] = young
        self._slots[young] = slot
        self._hashes[young] = block_hash
        self._mark_live(young, young + 1)

    def _removed(self, source: _Source, hashes: Sequence[BlockHash]) -> None:
        """`_drop` of each block, inline (as hot as `_chain` once the engines' caches are full)."""
        slots, hashes_at, holders, by_hash, live = self._slots, self._hashes, self._holders, source.by_hash, self._live
        kept = ~source.bit
        for block_hash in hashes:
            seq = by_hash.pop(block_hash, None)
            if seq is None:
                continue  # stored before we subscribed, skipped, or evicted: nothing to undo
            key = slots.pop(seq) >> _SOURCE_BITS
            del hashes_at[seq]
            run = seq >> _RUN_BITS
            mask = live[run] & ~(1 << (seq & _RUN_MASK))
            if mask:
                live[run] = mask
            else:
                del live[run]
            holding = holders[key] & kept
            if holding:
                holders[key] = holding
            else:
                del holders[key]

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

    def _evict(self) -> None:
        """Forget the least recently stored block."""
        seq = self._first()
        self._oldest = seq + 1
        slot = self._slots.pop(seq)
        block_hash = self._hashes.pop(seq)
        self._release(seq)
        source = self._by_sid[slot & _SOURCE_MASK]
        del source.by_hash[block_hash]
        self._unhold(slot >> _SOURCE_BITS, source.bit)
        self.evicted += 1

    def _first(self) -> int:
        """The lowest sequence number held: in the cursor's run of 64 or one of the next
        few (removals follow the engines' eviction order, close to ours), else, past a
        longer gap (a block held long, then removed), the first run in `_live`'s order
        (runs are added in order), found in one scan of that small map."""
        seq, live = self._oldest, self._live
        run = seq >> _RUN_BITS
        mask = live.get(run, 0) >> (seq & _RUN_MASK) << (seq & _RUN_MASK)
        for _ in range(_RUN_STEPS):
            if mask:
                break
            run += 1
            mask = live.get(run, 0)
        else:
            run = next(iter(live))
            mask = live[run]
        return (run << _RUN_BITS) + (mask & -mask).bit_length() - 1

    def _release(self, seq: int) -> None:
        """`seq` no longer held (`_live`)."""
        run = seq >> _RUN_BITS
        mask = self._live[run] & ~(1 << (seq & _RUN_MASK))
        if mask:
            self._live[run] = mask
        else:
            del self._live[run]

    def _drop(self, source: _Source, block_hash: BlockHash) -> None:
        seq = source.by_hash.pop(block_hash, None)
        if seq is None:
            return  # stored before we subscribed, skipped, or evicted: nothing to undo
        slot = self._slots.pop(seq)
        del self._hashes[seq]
        self._release(seq)
        self._unhold(slot >> _SOURCE_BITS, source.bit)

    def _unhold(self, key: int, bit: int) -> None:
        holders = self._holders[key] & ~bit
        if holders:
            self._holders[key] = holders
        else:
            del self._holders[key]

    def _clear(self, source: _Source) -> None:
        slots, hashes_at = self._slots, self._hashes
        for seq in source.by_hash.values():
            self._unhold(slots.pop(seq) >> _SOURCE_BITS, source.bit)
            del hashes_at[seq]
            self._release(seq)
        source.by_hash.clear()
