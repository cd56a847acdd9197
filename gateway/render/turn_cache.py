"""The token ids of rendered chat turns, shared by a renderer's threads, bounded in bytes.

An agent re-sends its whole conversation every turn (a median of 43 turns and
142K input tokens), so nearly every segment of a prompt was tokenized for the
same conversation's previous turn. This keeps each segment's ids as a
`TokenIds` (`array('I')`, 4 bytes a token, with their JSON text, ~6 more; a
Python list of ints costs ~36) under a 16-byte SHA-256 digest of the segment's
text (the text itself is not kept), least recently used first out. At 64 MiB of
lists and texts the old cache held about ten 140K-token sessions and then
thrashed (issue #32: a 201 ms render per turn at twelve sessions, 7.8 ms at
four); the same memory holds ~45 here, and the default budget ~360.

A digest match is taken as equal text: a 128-bit SHA-256 collision between two
segments is not a risk worth a comparison of the text on every hit.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from gateway.render.token_ids import TokenIds

DIGEST_BYTES = 16
ENTRY_BYTES = 280
"""What an entry costs besides its ids and their text: the digest (49 bytes), the array's
header (88), the text's (33) and the ordered dict's slot and link (~110)."""


def digest(segment: str) -> bytes:
    """SHA-256, first 16 bytes: every turn digests the whole rendered conversation (~850 KB
    for 140K tokens), and SHA-256 with the CPU's SHA extensions (x86 since ~2017, Arm v8)
    takes 0.48 ms for it where BLAKE2b took 0.83 ms."""
    # surrogatepass: a lone surrogate in a JSON string reaches the text as it is.
    return hashlib.sha256(segment.encode("utf-8", "surrogatepass")).digest()[:DIGEST_BYTES]


def entry_bytes(ids: TokenIds) -> int:
    return ENTRY_BYTES + ids.nbytes


class TurnCache:
    """Segment digest → ids, least recently used evicted past `budget` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._entries: OrderedDict[bytes, TokenIds] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, keys: Sequence[bytes]) -> list[TokenIds | None]:
        """The ids cached for each key (None where there are none), each hit made most recent."""
        entries = self._entries
        found: list[TokenIds | None] = []
        with self._lock:
            for key in keys:
                hit = entries.get(key)
                if hit is not None:
                    entries.move_to_end(key)
                found.append(hit)
        return found

    def store(self, items: Iterable[tuple[bytes, TokenIds]]) -> None:
        """Keep these; an entry over an eighth of the budget is not kept (it would evict many others)."""
        entries = self._entries
        with self._lock:
            for key, ids in items:
                size = entry_bytes(ids)
                if size > self.budget // 8 or key in entries:
                    continue
                entries[key] = ids
                self.bytes += size
            while self.bytes > self.budget and entries:
                _, evicted = entries.popitem(last=False)
                self.bytes -= entry_bytes(evicted)
