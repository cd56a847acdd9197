"""The simulator's prefill lane: one engine's prompts prefill one after another.

Prefill is compute bound. vLLM fills each step with prompt chunks up to a token budget, so an
engine prefills at about a fixed number of tokens a second however many prompts wait, and a
prompt sent behind others waits for theirs. Were every request to prefill on its own timer,
load would not show in time to first token, and routing that weighs a cached prefix against
an engine's queue could not be measured. The lane is that budget as one FIFO queue: a
request's prefill starts when the one before it ends, at its planned end (a late timer does
not push the lane back), and lasts as long as the backend says when it starts.

A request's prefill is planned when it starts, not when it joins, as vLLM's scheduler looks a
waiting request up in the prefix cache when it schedules it: a prompt queued behind another
with the same prefix finds the blocks the earlier prefill stored. A request that leaves (an
abort, a client gone) is taken out at once: unstarted, it costs the lane nothing; prefilling,
its compute stops there and the next starts, so no aborted work is charged to anyone behind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.backends.base import BackendRequest
from engine.backends.sim.prefix_cache import Lookup


class Prefill:
    """One request's place in the lane; `done` is set when its prefill ends."""

    __slots__ = ("done", "ends_at", "joined_at", "lookup", "queued_s", "request", "timer")

    def __init__(self, request: BackendRequest, done: asyncio.Future[None]) -> None:
        self.request = request
        self.done = done
        self.joined_at = done.get_loop().time()
        self.lookup: Lookup | None = None
        """The prefix cache's answer, taken when the prefill starts (None without a cache)."""
        self.queued_s: float | None = None
        """Seconds from joining to the prefill's start, once it started."""
        self.ends_at: float | None = None
        """The loop time the prefill ends, once it started."""
        self.timer: asyncio.TimerHandle | None = None


class PrefillLane:
    """Prefills in arrival order, one at a time.

    `start(prefill)` is called as a prefill starts and returns its length in seconds (the
    place to look the prompt up); `end(prefill)` as it ends, before the next one starts (the
    place to store its blocks, so the next lookup sees them).
    """

    def __init__(self, start: Callable[[Prefill], float], end: Callable[[Prefill], None]) -> None:
        self._start = start
        self._end = end
        self._queue: deque[Prefill] = deque()
        self._current: Prefill | None = None

    @property
    def waiting(self) -> int:
        """Requests queued whose prefill has not started (vLLM's `num_requests_waiting`)."""
        return len(self._queue)

    def join(self, prefill: Prefill) -> None:
        self._queue.append(prefill)
        if self._current is None:
            self._advance(prefill.done.get_loop().time())

    def leave(self, prefill: Prefill) -> None:
        """Take a request out, unstarted or mid-prefill; a no-op once its prefill ended."""
        if prefill is self._current:
            if prefill.timer is not None:
                prefill.timer.cancel()
                prefill.timer = None
            self._current = None
            self._advance(prefill.done.get_loop().time())
        elif prefill in self._queue:
            self._queue.remove(prefill)

    def clear(self) -> None:
        """Drop every prefill, started or not, ending none (the backend is closing)."""
        if self._current is not None and self._current.timer is not None:
            self._current.timer.cancel()
            self._current.timer = None
        self._current = None
        self._queue.clear()

    def _advance(self, free: float) -> None:
        """Start the next queued prefill: at loop time `free`, when the lane came free, or at
        its arrival if that was later (a late timer can run after a request joined)."""
        if self._current is not None or not self._queue:
            return
        prefill = self._queue.popleft()
        starts = max(free, prefill.joined_at)
        prefill.queued_s = starts - prefill.joined_at
        prefill.ends_at = starts + self._start(prefill)
        prefill.timer = prefill.done.get_loop().call_at(prefill.ends_at, self._finish, prefill)
        self._current = prefill

    def _finish(self, prefill: Prefill) -> None:
        self._current = None
        prefill.timer = None
        self._end(prefill)
        if not prefill.done.done():  # a consumer cancelled while waiting cancels it
            prefill.done.set_result(None)
        assert prefill.ends_at is not None
        self._advance(prefill.ends_at)
