"""Marker recognition for text that arrives without token boundaries (the text route).

On the token route the parser sees each marker as its own token id. When an
engine answers in `text` mode the gateway only has text deltas, so markers are
found by their strings instead: `MarkerSplitter` turns text deltas into the
same `(text, token_id)` pieces, holding back a suffix that could still become
a marker (`"<"`, `"</thi"`) until the next delta or the finish. For outputs in
which marker strings come only from marker tokens — what models produce —
both routes give the parser identical pieces, hence identical answers.
"""

from __future__ import annotations

import re

from collections.abc import Mapping

from derender.stop import Piece


class MarkerSplitter:
    __slots__ = ("_firsts", "_held", "_ids", "_longest", "_pattern", "_prefixes")

    def __init__(self, marker_ids: Mapping[str, int]) -> None:
        self._ids = dict(marker_ids)
        ordered = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(text) for text in ordered)) if ordered else None
        self._prefixes = frozenset(text[:size] for text in ordered for size in range(1, len(text)))
        self._longest = max((len(p) for p in self._prefixes), default=0)
        self._firsts = tuple({text[0] for text in ordered})
        """Every marker, and every prefix of one, starts with one of these: text without any is plain."""
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        buffer = self._held + text if self._held else text
        self._held = ""
        if self._pattern is None or not self._may_hold_marker(buffer):
            return [(buffer, -1)] if buffer else []
        pieces: list[Piece] = []
        position = 0
        for match in self._pattern.finditer(buffer):
            if match.start() > position:
                pieces.append((buffer[position : match.start()], -1))
            pieces.append((match.group(), self._ids[match.group()]))
            position = match.end()
        rest = buffer[position:]
        hold = self._partial_suffix(rest)
        if hold:
            self._held = rest[-hold:]
            rest = rest[:-hold]
        if rest:
            pieces.append((rest, -1))
        return pieces

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [(held, -1)] if held else []

    def _may_hold_marker(self, text: str) -> bool:
        return any(map(text.__contains__, self._firsts))  # map: no generator frame per token

    def _partial_suffix(self, text: str) -> int:
        for size in range(min(len(text), self._longest), 0, -1):
            if text[-size:] in self._prefixes:
                return size
        return 0
