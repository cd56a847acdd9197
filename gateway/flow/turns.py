"""New requests start one per event-loop turn, so a burst's first tokens are not all held up
behind its last arrivals' parsing and render.

An event loop runs every callback that is ready before it polls its sockets
again. When many requests arrive at once, every one of them is ready, and each
runs its whole way to the engine (decode, checks, render, routing: ~0.5 ms of
CPU here) before the loop next reads a socket: the engines' answers to the
first requests, and their first tokens, wait for the last request's render.
With 128 streams started at once on one worker, the first engine answer came
back 50 ms after its request was sent (issue #32), most of it this wait. A
render on a thread used to break the run up (at the cost of a hand-off per
request, `gateway.flow.inline_render`); this does it on purpose, for less.

`Turns.take()` lets one request through per turn of the loop: the next waits
until the loop has polled its sockets again (a callback scheduled now runs
after that poll), so what the engines have answered meanwhile is relayed
between two requests' way in. Order is arrival order. The CPU spent is the
same, one more callback per request; a request that arrives when none went
through in this turn is not delayed at all.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    """One request through per turn of the running loop; the rest wait, first come first."""

    __slots__ = ("_taken", "_waiting")

    def __init__(self) -> None:
        self._taken = False
        """Whether one went through in this turn (a callback to hand on the turn is pending)."""
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def take(self) -> None:
        """Return once this request may go on: at once if the turn is free, else after the
        loop has polled its sockets once for each request ahead of it."""
        loop = asyncio.get_running_loop()
        if not self._taken:
            self._taken = True
            loop.call_soon(self._hand_on)
            return
        turn = loop.create_future()
        self._waiting.append(turn)
        await turn  # cancelled (the client left): `_hand_on` skips it

    def _hand_on(self) -> None:
        """A new turn: let the next waiter through, and hand on again in the turn after."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                asyncio.get_running_loop().call_soon(self._hand_on)
                return
        self._taken = False
