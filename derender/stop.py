"""Stop strings over a stream of decoded pieces.

A *piece* is `(text, token_id)`: the text one token completed, or
`(text, -1)` for text no single token owns (a UTF-8 flush, a split). Pieces
flow from the detokenizer through here to the parser in order.

Rules (DERENDER_CASES 4, 5, 7):
- text is released as soon as it cannot be the start of a stop string: only
  the longest suffix that is still a proper prefix of some stop is held, never
  a fixed `max_len - 1` window;
- a match may span tokens or sit inside one token; the match that *ends*
  earliest wins, ties go to the earlier stop in the list;
- the token completing the match is the last kept; later ids in the same step
  are dropped so `token_ids` and logprobs stay aligned with the text;
- matches ending inside the text of the first `min_tokens` tokens are ignored;
- a held piece whose id is *atomic* (a parser marker) is never split, so a
  marker's text always reaches the parser together with its id.

Work per feed is bounded by the held text plus the new text (O(delta)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Piece = tuple[str, int]


@dataclass(frozen=True, slots=True)
class StopHit:
    stop: str
    """The stop string that matched."""
    kept: int
    """How many of the pieces passed to this `feed` call survive (the completing one included)."""


class StopStrings:
    """Per-choice stop-string state."""

    __slots__ = (
        "_atomic",
        "_include",
        "_max_hold",
        "_min_end",
        "_min_tokens",
        "_pending",
        "_pending_len",
        "_released",
        "_stops",
        "_tokens",
    )

    def __init__(
        self,
        stops: Sequence[str],
        *,
        include_in_output: bool = False,
        min_tokens: int = 0,
        atomic_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_in_output
        self._min_tokens = min_tokens
        self._atomic = atomic_ids
        self._pending: list[Piece] = []
        self._pending_len = 0
        self._released = 0  # chars released before `_pending`
        self._tokens = 0
        self._min_end: int | None = 0 if min_tokens <= 0 else None
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1

    def feed(self, pieces: Sequence[Piece]) -> tuple[list[Piece], StopHit | None]:
        """Add one step's pieces; return the releasable pieces and a hit, if any."""
        old_len = self._pending_len
        new_ends = self._track_min_tokens(pieces, old_len)
        self._pending.extend(pieces)
        text = "".join(piece[0] for piece in self._pending)
        self._pending_len = len(text)
        found = self._search(text, old_len)
        if found is not None:
            return self._cut(text, found, new_ends, len(pieces))
        return self._release(len(text) - self._held_suffix(text)), None

    def finish(self) -> list[Piece]:
        """Release everything held: the output ended without a match."""
        out = self._pending
        self._pending = []
        self._released += self._pending_len
        self._pending_len = 0
        return out

    def _track_min_tokens(self, pieces: Sequence[Piece], start: int) -> list[int]:
        """Cumulative end offset (in pending coordinates) of each new piece."""
        ends: list[int] = []
        end = start
        for text, token_id in pieces:
            end += len(text)
            ends.append(end)
            if token_id >= 0:
                self._tokens += 1
                if self._min_end is None and self._tokens >= self._min_tokens:
                    self._min_end = self._released + end
        return ends

    def _search(self, text: str, old_len: int) -> tuple[int, int, str] | None:
        """(start, end, stop) of the valid match ending earliest in the new text."""
        if self._min_end is None:
            return None
        floor = self._min_end - self._released
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = max(0, old_len - len(stop) + 1)
            while (idx := text.find(stop, start)) != -1:
                end = idx + len(stop)
                if end > floor:
                    if best is None or end < best[1]:
                        best = (idx, end, stop)
                    break
                start = idx + 1
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix that is a proper prefix of a stop string."""
        for size in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-size:]
            for stop in self._stops:
                if len(stop) > size and stop.startswith(tail):
                    return size
        return 0

    def _release(self, upto: int) -> list[Piece]:
        """Release pending text before offset `upto`, never splitting an atomic piece."""
        if upto <= 0:
            return []
        if upto >= self._pending_len:
            return self.finish()
        released: list[Piece] = []
        offset = 0
        pending = self._pending
        index = 0
        while index < len(pending):
            text, token_id = pending[index]
            end = offset + len(text)
            if end > upto:
                if token_id not in self._atomic and upto > offset:
                    split = upto - offset
                    released.append((text[:split], -1))
                    pending[index] = (text[split:], token_id)
                    offset = upto
                break
            released.append(pending[index])
            offset = end
            index += 1
        del pending[:index]
        self._released += offset
        self._pending_len -= offset
        return released

    def _cut(
        self, text: str, found: tuple[int, int, str], new_ends: list[int], n_new: int
    ) -> tuple[list[Piece], StopHit]:
        start, end, stop = found
        keep_to = end if self._include else start
        kept_new = next(i for i, piece_end in enumerate(new_ends) if piece_end >= end) + 1
        n_old = len(self._pending) - n_new
        out: list[Piece] = []
        offset = 0
        for piece_text, token_id in self._pending[: n_old + kept_new]:
            if offset >= keep_to:
                # The stop string's own tokens stay as empty pieces: no text, but the
                # parsers still see the ids (reasoning-token counts include them).
                if token_id >= 0:
                    out.append(("", token_id))
                continue
            piece_end = offset + len(piece_text)
            if piece_end > keep_to:
                piece_text = piece_text[: keep_to - offset]
            out.append((piece_text, token_id))
            offset = piece_end
        self._pending = []
        self._released += self._pending_len
        self._pending_len = 0
        return out, StopHit(stop=stop, kept=kept_new)
