"""The admission queue's discipline (`gateway.edge.admission`), on a real event loop: requests
are tasks holding a slot until the test lets each go, so the order slots are granted in is
observed, not inferred."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from gateway.config import Admission
from gateway.edge.admission import Claim, Gate
from gateway.edge.errors import GatewayError, RateLimited, Saturated
from tests.support.waiting import wait_until


@dataclass
class Recorded:
    """What the gate reported (its `Signals`)."""

    rejected: list[str] = field(default_factory=list)
    waited: list[tuple[int, float]] = field(default_factory=list)
    queued: dict[int, int] = field(default_factory=dict)
    in_use: int = 0


class Signals:
    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    def rejected(self, reason: str) -> None:
        self.recorded.rejected.append(reason)

    def queued(self, priority: int, waiting: int) -> None:
        self.recorded.queued[priority] = waiting

    def waited(self, priority: int, seconds: float) -> None:
        self.recorded.waited.append((priority, seconds))

    def in_use(self, used: int, capacity: int | None) -> None:
        self.recorded.in_use = used


class Requests:
    """Requests as tasks: each takes a slot, notes that it got it, and holds it until let go."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.served: list[str] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._done: dict[str, asyncio.Event] = {}

    def send(self, name: str, claim: Claim, tokens: int = 100) -> asyncio.Task[None]:
        self._done[name] = done = asyncio.Event()

        async def run() -> None:
            async with self.gate.slot(claim, lambda: tokens):
                self.served.append(name)
                await done.wait()

        task = self.tasks[name] = asyncio.ensure_future(run())
        return task

    async def sent(self, *requests: tuple[str, Claim], tokens: int = 100) -> None:
        """Send each, in order, and let each reach the gate before the next is sent."""
        for name, claim in requests:
            await self._arrived(name, self.send(name, claim, tokens))

    async def _arrived(self, name: str, task: asyncio.Task[None]) -> None:
        """Wait until `task`'s request was queued, granted or refused."""
        gate = self.gate
        held, rejected = gate.waiting + gate.in_use, gate.rejected
        await wait_until(
            lambda: task.done() or gate.waiting + gate.in_use > held or gate.rejected > rejected,
            what=f"{name} at the gate",
        )

    async def finish(self, name: str) -> None:
        """Let `name` end; if its slot went to a waiting request, wait until that one runs."""
        served, in_use = len(self.served), self.gate.in_use
        self._done[name].set()
        await self.tasks[name]
        if self.gate.in_use == in_use:  # given back and granted again, in the same step
            await wait_until(lambda: len(self.served) > served, what=f"the slot {name} held to be taken")

    async def drain(self) -> list[str]:
        """Finish requests in the order they were served until none is left; that order."""
        finished = 0
        while finished < len(self.served):
            await self.finish(self.served[finished])
            finished += 1
        return self.served


@asynccontextmanager
async def gate(**admission: float | int | None) -> AsyncIterator[tuple[Gate, Requests, Recorded]]:
    recorded = Recorded()
    config = Admission(**{"max_concurrency": 1, "max_queue": 64, "queue_timeout_s": 10, **admission})  # type: ignore[arg-type]
    the_gate = Gate(config, Signals(recorded))
    requests = Requests(the_gate)
    try:
        yield the_gate, requests, recorded
    finally:
        for task in requests.tasks.values():
            task.cancel()
        await asyncio.gather(*requests.tasks.values(), return_exceptions=True)


A, B, C = Claim(tenant="a"), Claim(tenant="b"), Claim(tenant="c")


async def test_a_more_urgent_request_goes_first() -> None:
    async with gate() as (_, requests, recorded):
        await requests.sent(("first", A), ("late", Claim("a", priority=5)), ("later", A), ("urgent", Claim("b", priority=-1)))
        assert recorded.queued == {5: 1, 0: 1, -1: 1}
        assert await requests.drain() == ["first", "urgent", "later", "late"]
        assert [priority for priority, _ in recorded.waited] == [0, -1, 0, 5]


async def test_within_a_tenant_first_come_first_served() -> None:
    async with gate() as (_, requests, _):
        await requests.sent(*((f"a{i}", A) for i in range(5)))
        assert await requests.drain() == [f"a{i}" for i in range(5)]


async def test_a_trickle_is_not_starved_by_a_burst() -> None:
    """Tenant a queues 6 at once; b's one request, sent last, goes after at most one more of a's."""
    async with gate() as (_, requests, _):
        await requests.sent(*((f"a{i}", A) for i in range(6)), ("b0", B))
        order = await requests.drain()
    assert order.index("b0") <= 2, order


async def test_fairness_follows_the_tokens_served() -> None:
    """Both tenants backlogged: a's requests cost 4 times b's tokens, so b is served about 4
    requests for each of a's once both tenants' costs are known."""
    async with gate() as (_, requests, _):
        for i in range(12):
            requests.send(f"a{i}", A, tokens=400)
        for i in range(12):
            requests.send(f"b{i}", B, tokens=100)
        await wait_until(lambda: requests.gate.waiting == 23, what="all queued")
        order = await requests.drain()
    # Once a's first request has shown its cost, b gets 4 for each of a's: all 12 before a's 4th.
    assert order[:6] == ["a0", "b0", "b1", "b2", "b3", "a1"], order
    assert order.index("b11") < order.index("a4"), order


async def test_weight_is_a_share_of_the_tokens() -> None:
    heavy = Claim("a", weight=3)
    async with gate() as (_, requests, _):
        for i in range(12):
            requests.send(f"a{i}", heavy)
            requests.send(f"b{i}", B)
        await wait_until(lambda: requests.gate.waiting == 23, what="all queued")
        order = await requests.drain()
    first = order[:16]
    assert sum(name.startswith("a") for name in first) == 12, order  # 3 of a's for each of b's


async def test_a_tenant_at_its_limit_waits_without_holding_back_others() -> None:
    capped = Claim("a", max_concurrency=1)
    async with gate(max_concurrency=3) as (the_gate, requests, _):
        await requests.sent(("a0", capped), ("a1", capped), ("b0", B), ("b1", B))
        assert requests.served == ["a0", "b0", "b1"] and the_gate.waiting == 1
        await requests.finish("b0")
        assert the_gate.in_use == 2 and the_gate.waiting == 1  # a1 still waits for a0's slot
        await requests.finish("a0")
        assert requests.served[-1] == "a1"


async def test_a_tenant_over_its_limit_and_queue_is_a_429() -> None:
    capped = Claim("a", max_concurrency=1, max_queue=1)
    async with gate(max_concurrency=4) as (the_gate, requests, recorded):
        await requests.sent(("a0", capped), ("a1", capped))
        with pytest.raises(RateLimited, match="tenant 'a' has 1 running and 1 waiting") as refused:
            async with the_gate.slot(capped):
                pass
        assert refused.value.headers == {"Retry-After": "1"}
        await requests.sent(("b0", B))  # others are not affected
        assert recorded.rejected == ["tenant_limit"] and requests.served == ["a0", "b0"]


async def test_a_full_queue_is_a_503_and_a_tenant_holding_more_than_its_share_makes_room() -> None:
    async with gate(max_queue=3) as (the_gate, requests, recorded):
        await requests.sent(("a0", A), ("a1", A), ("a2", A), ("a3", A))
        with pytest.raises(Saturated, match="1 running, 3 waiting") as full:
            async with the_gate.slot(A):
                pass
        assert full.value.status == 503 and full.value.headers == {"Retry-After": "1"}
        # b holds none of the queue: a's newest waiting request leaves with a 429 for it.
        await requests.sent(("b0", B))
        with pytest.raises(RateLimited, match="holds more of it than its share"):
            await requests.tasks["a3"]
        assert recorded.rejected == ["queue_full", "queue_share"] and the_gate.waiting == 3
        assert await requests.drain() == ["a0", "b0", "a1", "a2"]


async def test_a_wait_that_runs_out_is_a_503_or_a_429_at_the_tenants_own_limit() -> None:
    capped = Claim("b", max_concurrency=1)
    async with gate(max_concurrency=2, queue_timeout_s=0.05) as (the_gate, requests, recorded):
        await requests.sent(("a0", A), ("b0", capped))
        with pytest.raises(RateLimited, match=r"kept 1 running for 0\.05 s"):
            async with the_gate.slot(capped):
                pass
        await requests.sent(("a1", A))
        with pytest.raises(Saturated, match=r"no slot within 0\.05 s"):
            await requests.tasks["a1"]
        assert recorded.rejected == ["tenant_limit", "queue_timeout"]
        assert the_gate.waiting == 0 and the_gate.in_use == 2


async def test_a_cancelled_waiter_gives_back_nothing_it_did_not_hold() -> None:
    async with gate() as (the_gate, requests, recorded):
        await requests.sent(("a0", A), ("a1", A), ("b0", B))
        requests.tasks["a1"].cancel()
        await asyncio.gather(requests.tasks["a1"], return_exceptions=True)
        assert the_gate.in_use == 1 and the_gate.waiting == 1 and recorded.in_use == 1
        await requests.finish("a0")
        assert requests.served == ["a0", "b0"] and the_gate.in_use == 1
        await requests.finish("b0")
        assert the_gate.in_use == 0 and the_gate.waiting == 0 and recorded.rejected == []


async def test_a_request_granted_as_it_is_cancelled_gives_its_slot_back() -> None:
    async with gate() as (the_gate, requests, _):
        go = asyncio.Event()

        async def first() -> None:
            async with the_gate.slot(A):
                await go.wait()
            # In the same step as the release that granted it the slot, before it runs again.
            requests.tasks["a1"].cancel()

        running = asyncio.ensure_future(first())
        await wait_until(lambda: the_gate.in_use == 1)
        await requests.sent(("a1", A))
        go.set()
        await running
        await asyncio.gather(requests.tasks["a1"], return_exceptions=True)
        assert requests.served == [] and the_gate.in_use == 0 and the_gate.waiting == 0
        await requests.sent(("b0", B))
        assert requests.served == ["b0"]


async def test_no_limit_admits_at_once_and_keeps_no_state() -> None:
    async with gate(max_concurrency=None) as (the_gate, requests, _):
        await requests.sent(*((f"x{i}", Claim(f"t{i}", priority=i)) for i in range(50)))
        assert len(requests.served) == 50 and the_gate.waiting == 0
        await requests.drain()
        assert the_gate.in_use == 0 and not the_gate._levels  # client-chosen priorities hold no memory


async def test_refusals_are_gateway_errors_with_retry_after() -> None:
    async with gate(max_queue=0, retry_after_s=7) as (the_gate, requests, _):
        await requests.sent(("a0", A))
        with pytest.raises(GatewayError) as refused:
            async with the_gate.slot(B):
                pass
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "7"}
