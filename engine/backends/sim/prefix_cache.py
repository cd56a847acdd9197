"""The simulator's prefix cache: the prompt's full blocks, chained, evicted least recently used first.

As in vLLM, only full blocks of the prompt are cached (a partial last block and the output
are not), and a block's identity is its tokens and its parent's identity, so a hit is always
a run of leading blocks. The first block's identity also holds the request's `cache_salt`:
requests with different salts share nothing. The hashes are this engine's own (the low 64
bits of a blake2b digest, as signed ints): a reader of the published events keys its index
by the tokens, and keeps these only to apply removals.

What the simulator leaves out: running requests do not pin their blocks (a small cache can
evict a prompt's blocks while it decodes), and there are no per-block reference counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wire.kv_events import BlockHash, BlockRemoved, BlockStored, Event

MEDIUM = "GPU"
"""The storage medium events name: the simulated cache stands for GPU memory."""
_ROOT = b"\xff" * 9
"""The parent of a prompt's first block: nine bytes, so no 8-byte hash can equal it."""


def block_hash(parent: int | None, tokens: Sequence[int], salt: str | None = None) -> int:
    """A block's identity: its parent's, its salt (first block only) and its tokens."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(_ROOT if parent is None else parent.to_bytes(8, "big", signed=True))
    if salt is not None:
        encoded = salt.encode()
        digest.update(len(encoded).to_bytes(4, "big") + encoded)
    digest.update(array("I", tokens).tobytes())
    return int.from_bytes(digest.digest(), "big", signed=True)


def prompt_hashes(ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of `ids`."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_hash(parent, ids[start : start + block_size], salt if start == 0 else None)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class Lookup:
    """One prompt's blocks and how many of them were held when the request arrived."""

    ids: Sequence[int]
    hashes: list[int]
    cached_tokens: int
    salt: str | None
    session_id: str | None


class PrefixCache:
    """Blocks by hash in recency order (least recent first); counts for vLLM's metrics."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        """Prompt tokens looked up (vLLM's `prefix_cache_queries`)."""
        self.hits = 0
        """Prompt tokens found cached (vLLM's `prefix_cache_hits`)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, ids: Sequence[int], salt: str | None = None, session_id: str | None = None) -> Lookup:
        """The run of leading full blocks held. As vLLM, the last prompt token is always
        computed (its logits are needed), so a prompt of whole blocks hits one block less."""
        hashes = prompt_hashes(ids, self.block_size, salt)
        most = min(len(hashes), (len(ids) - 1) // self.block_size)
        held = 0
        while held < most and hashes[held] in self._blocks:
            held += 1
        cached = held * self.block_size
        self.queries += len(ids)
        self.hits += cached
        return Lookup(ids, hashes, cached, salt, session_id)

    def store(self, lookup: Lookup) -> list[Event]:
        """Keep the prompt's full blocks after its prefill; the events that changed the cache.

        The blocks are touched last to first, so the first is the most recent: eviction then
        takes a chain's tail before its head, and never leaves a held block whose parent is
        gone (a block nobody could reach), as vLLM's free queue does.
        """
        new = [h not in self._blocks for h in lookup.hashes]
        for block in reversed(lookup.hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        events: list[Event] = [self._stored(lookup, start, end) for start, end in _runs(new)]
        evicted: list[BlockHash] = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM))
        return events

    def clear(self) -> None:
        self._blocks.clear()

    def _stored(self, lookup: Lookup, start: int, end: int) -> BlockStored:
        """Blocks `start` to `end` (exclusive) of the prompt, as one event."""
        size = self.block_size
        salted = lookup.salt is not None and start == 0
        extra: list[list[Any] | None] | None = None
        if salted:
            extra = [[lookup.salt], *([None] * (end - start - 1))]
        return BlockStored(
            block_hashes=list[BlockHash](lookup.hashes[start:end]),
            parent_block_hash=lookup.hashes[start - 1] if start else None,
            token_ids=list(lookup.ids[start * size : end * size]),
            block_size=size,
            medium=MEDIUM,
            extra_keys=extra,
            session_id=lookup.session_id,
        )


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """The (start, end) of each run of true flags."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for index, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    return runs
