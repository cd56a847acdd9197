"""New requests go on one per turn of the event loop, in arrival order."""

from __future__ import annotations

import asyncio
import itertools

from gateway.flow.turns import Turns
from plumbing.http_server import new_event_loop


class LoopTurns:
    """Counts the loop's turns: a callback that schedules itself runs once per turn."""

    def __init__(self) -> None:
        self.count = 0
        self._stopped = False

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True

    def _tick(self) -> None:
        if not self._stopped:
            self.count += 1
            asyncio.get_running_loop().call_soon(self._tick)


def run(coroutine: object) -> object:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coroutine)  # type: ignore[arg-type]
    finally:
        loop.close()


def test_a_request_alone_goes_on_at_once() -> None:
    async def alone() -> int:
        turns, clock = Turns(), LoopTurns()
        clock.start()
        await turns.take()
        clock.stop()
        return clock.count

    assert run(alone()) == 0


def test_requests_arriving_together_go_on_one_per_turn_in_order() -> None:
    async def together() -> list[tuple[int, int]]:
        turns, clock = Turns(), LoopTurns()
        went: list[tuple[int, int]] = []

        async def request(index: int) -> None:
            await turns.take()
            went.append((index, clock.count))

        clock.start()
        await asyncio.gather(*(request(i) for i in range(5)))
        clock.stop()
        return went

    went = run(together())
    assert [index for index, _ in went] == [0, 1, 2, 3, 4]
    at = [turn for _, turn in went]
    assert all(later > earlier for earlier, later in itertools.pairwise(at)), at  # never two in one turn


def test_a_request_that_leaves_while_waiting_does_not_hold_up_the_rest() -> None:
    async def one_leaves() -> list[int]:
        turns = Turns()
        went: list[int] = []

        async def request(index: int) -> None:
            await turns.take()
            went.append(index)

        first = asyncio.ensure_future(request(0))
        second = asyncio.ensure_future(request(1))
        third = asyncio.ensure_future(request(2))
        await first
        second.cancel()
        await third
        assert second.cancelled()
        assert turns.waiting == 0
        return went

    assert run(one_leaves()) == [0, 2]
