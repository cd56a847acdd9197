"""Admission control: which waiting request is served next, and which are refused.

At most `admission.max_concurrency` requests are served at once, and each tenant at most its
own `max_concurrency`; a slot is held to the answer's last byte, streams included. Beyond
that, requests wait in one queue (at most `admission.max_queue`), served in this order:

1. by priority: the lowest value first (vLLM's convention). A waiting request of a lower
   value always goes before one of a higher value;
2. within one priority, fairly across tenants, by start-time fair queueing. Each tenant's
   requests at that priority (a flow) carry a finish tag in virtual time, which grows by the
   tokens the flow is served divided by its tenant's weight. The flow whose head would start
   first, at max(the priority's virtual time, its finish tag), goes next, and the virtual
   time becomes that start. A tenant that was idle starts at the current virtual time, so it
   banks no credit; a tenant with a burst does not starve one with a trickle, whose request
   goes before the burst's next one whenever its tenant has been served fewer tokens.
   Tokens are known when a request ends, so an admitted request is charged its tenant's
   recent mean at once and the difference to its real prompt + completion tokens (the
   request's tally, which its outcome reports) when its slot is given back;
3. within one tenant and priority, first come, first served.

A tenant at its `max_concurrency` waits without holding back the others. Refusals, each
with `Retry-After` (`reason` is the metric's label):

    429 tenant_limit   the tenant is at its max_concurrency with its max_queue waiting, or
                       its wait ran out while it was at its max_concurrency
    429 queue_share    the queue was full when a tenant with fewer requests waiting (per
                       unit of weight) arrived: this tenant's newest waiting request made room
    503 queue_full     the queue is full and no other tenant holds more of it: saturated
    503 queue_timeout  no slot within queue_timeout_s: saturated

One gate per gateway process: under `--workers N` each worker has its own queue and, with
`state.backend: memory`, its own slots and its own counters.
With `state.backend: redis` an admitted request also takes a lease in Redis before it is
served (`gateway.edge.shared_slots`), so the limits hold across workers and replicas; the
queue's wait (`queue_timeout_s`) bounds both, and a request that found no lease in it is
refused as above (429 when its tenant's own count was full, else 503). The tokens each tenant
is charged are shared too (`gateway.edge.shared_fairness`, every `state.fairness_sync_s`):
a tenant's requests here are ordered as if they started later by what it was served recently
in the other processes, and leases go across processes by priority, then to the tenant
served less recently, everywhere.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config import Admission
from gateway.edge.errors import GatewayError, RateLimited, Saturated
from gateway.edge.shared_fairness import SharedFairness
from gateway.edge.shared_slots import GRANTED, TENANT_FULL, Place, SharedSlots

FIRST_COST = 256.0
"""Tokens charged on admission for a tenant's first request, before its mean is known."""
MEAN_SMOOTHING = 0.2
"""The weight of each ended request in its tenant's running mean of tokens per request."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Who asks for a slot, and on what terms (the tenant's config and the request's priority)."""

    tenant: str | None
    """None: requests without a tenant, which share one flow."""
    priority: int = 0
    weight: float = 1.0
    max_concurrency: int | None = None
    max_queue: int | None = None


ANONYMOUS = Claim(tenant=None)


class Signals(Protocol):
    """What the gate reports as it works (the metrics an autoscaler reads)."""

    def rejected(self, reason: str) -> None: ...

    def queued(self, priority: int, waiting: int) -> None:
        """Requests of this priority now waiting."""

    def waited(self, priority: int, seconds: float) -> None:
        """A request of this priority got its slot after waiting this long."""

    def in_use(self, used: int, capacity: int | None) -> None: ...


class Quiet:
    """Signals nobody listens to."""

    def rejected(self, reason: str) -> None:
        pass

    def queued(self, priority: int, waiting: int) -> None:
        pass

    def waited(self, priority: int, seconds: float) -> None:
        pass

    def in_use(self, used: int, capacity: int | None) -> None:
        pass


@dataclass(slots=True)
class _Tenant:
    running: int = 0
    waiting: int = 0
    weight: float = 1.0
    mean_cost: float = FIRST_COST


@dataclass(slots=True)
class _Level:
    """The waiting requests of one priority."""

    priority: int
    virtual: float = 0.0
    waiting: int = 0
    running: int = 0
    flows: dict[str | None, _Flow] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class _Flow:
    """One tenant's requests at one priority."""

    level: _Level
    tenant: str | None
    finish: float = 0.0
    running: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)


@dataclass(eq=False, slots=True)
class _Waiter:
    claim: Claim
    flow: _Flow
    seq: int
    since: float
    future: asyncio.Future[None]
    queued: bool = True
    granted: bool = False
    charged: float = 0.0
    """Tokens charged when admitted (the tenant's mean then): corrected at release."""


class Gate:
    def __init__(
        self,
        config: Admission,
        signals: Signals | None = None,
        shared: SharedSlots | None = None,
        fairness: SharedFairness | None = None,
    ) -> None:
        self.config = config
        self.shared = shared
        self.fairness = fairness
        self._giving_back: set[asyncio.Task[None]] = set()
        self._signals: Signals = signals if signals is not None else Quiet()
        self.capacity = config.max_concurrency
        self.in_use = 0
        self.waiting = 0
        self.rejected = 0
        self._levels: dict[int, _Level] = {}
        self._tenants: dict[str | None, _Tenant] = {}
        self._seq = itertools.count()

    @asynccontextmanager
    async def slot(self, claim: Claim = ANONYMOUS, spent: Callable[[], int] | None = None) -> AsyncIterator[None]:
        """Hold a slot while inside; `spent()`, read at the end, is the tokens the request was
        served (None: it is charged its tenant's mean)."""
        waiter = await self._admit(claim)
        lease = ""
        if self.shared is not None:
            try:
                lease = await self._leased(waiter, self.shared)
            except BaseException:
                self._release(waiter, None)
                raise
        try:
            yield
        finally:
            self._release(waiter, spent() if spent is not None else None)
            if lease:
                self._give_back(lease)

    async def _leased(self, waiter: _Waiter, shared: SharedSlots) -> str:
        """A lease of the shared slots, taken within the queue's wait (it began at arrival)."""
        claim, loop = waiter.claim, asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s - (time.perf_counter() - waiter.since)
        while True:
            verdict, lease = await shared.take(claim.tenant, self.capacity, claim.max_concurrency, self._place(claim))
            if verdict == GRANTED:
                return lease
            if loop.time() >= deadline:
                if verdict == TENANT_FULL:
                    raise self._refuse(
                        RateLimited, "tenant_limit",
                        f"{_named(claim)} kept {claim.max_concurrency} running for {self.config.queue_timeout_s} s",
                    )
                raise self._refuse(Saturated, "queue_timeout", f"no slot within {self.config.queue_timeout_s} s")
            await shared.wait()

    def _give_back(self, lease: str) -> None:
        """In the background: the request's answer is done, and a cancelled one must not wait."""
        assert self.shared is not None
        task = asyncio.ensure_future(self.shared.give_back(lease))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def close(self) -> None:
        if self._giving_back:
            await asyncio.wait(list(self._giving_back), timeout=self.config.queue_timeout_s)
        if self.shared is not None:
            await self.shared.close()
        if self.fairness is not None:
            await self.fairness.close()

    # ------------------------------------------------------------ fairness across processes

    def _place(self, claim: Claim) -> Place | None:
        """The request's place in the order leases are taken in across processes, if shared."""
        if self.fairness is None:
            return None
        return Place(claim.priority, self.fairness.rank(claim.tenant), self.fairness.bucket(claim.tenant))

    def _charge(self, tenant: str | None, tokens_per_weight: float) -> None:
        if self.fairness is not None:
            self.fairness.charge(tenant, tokens_per_weight)

    def _elsewhere(self, tenant: str | None) -> float:
        """Tokens per weight the tenant was served recently by the other processes: its
        requests here are ordered as if they started that much later in virtual time."""
        return 0.0 if self.fairness is None else self.fairness.elsewhere(tenant)

    # ------------------------------------------------------------ admission

    async def _admit(self, claim: Claim) -> _Waiter:
        tenant = self._tenant(claim)
        if claim.max_queue is not None and self._at_limit(claim, tenant) and tenant.waiting >= claim.max_queue:
            raise self._refuse(
                RateLimited, "tenant_limit",
                f"{_named(claim)} has {claim.max_concurrency} running and {tenant.waiting} waiting",
            )
        waiter = self._enqueue(claim, tenant)
        self._dispatch()
        if waiter.granted:
            return waiter
        if self.waiting > self.config.max_queue:
            self._make_room(waiter, tenant)
        await self._wait(waiter, tenant)
        return waiter

    async def _wait(self, waiter: _Waiter, tenant: _Tenant) -> None:
        """Until `waiter` is granted a slot; refused (timed out, shed) or cancelled, it leaves
        the queue holding nothing."""
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await waiter.future
        except BaseException as exc:
            if waiter.granted and isinstance(exc, TimeoutError):
                return  # the slot came as the wait ran out: take it
            if waiter.granted:  # cancelled (the client left) just as it was granted
                self._release(waiter, None)
            else:
                self._withdraw(waiter)
            if isinstance(exc, TimeoutError):
                raise self._timed_out(waiter.claim, tenant) from None
            raise

    def _tenant(self, claim: Claim) -> _Tenant:
        tenant = self._tenants.get(claim.tenant)
        if tenant is None:
            tenant = self._tenants[claim.tenant] = _Tenant()
        tenant.weight = claim.weight  # the config as this request saw it (reloads included)
        return tenant

    @staticmethod
    def _at_limit(claim: Claim, tenant: _Tenant) -> bool:
        return claim.max_concurrency is not None and tenant.running >= claim.max_concurrency

    def _enqueue(self, claim: Claim, tenant: _Tenant) -> _Waiter:
        level = self._levels.get(claim.priority)
        if level is None:
            level = self._levels[claim.priority] = _Level(claim.priority)
            self._levels = dict(sorted(self._levels.items()))  # few priorities: kept in order
        flow = level.flows.get(claim.tenant)
        if flow is None:
            flow = level.flows[claim.tenant] = _Flow(level, claim.tenant, finish=level.virtual)
        waiter = _Waiter(claim, flow, next(self._seq), time.perf_counter(), asyncio.get_running_loop().create_future())
        flow.waiting.append(waiter)
        level.waiting += 1
        tenant.waiting += 1
        self.waiting += 1
        self._signals.queued(level.priority, level.waiting)
        return waiter

    def _make_room(self, newcomer: _Waiter, tenant: _Tenant) -> None:
        """The queue is one over: the newest request of the tenant holding the most of it (per
        unit of weight) leaves with a 429, if that is another tenant's; else the newcomer gets a 503."""
        own = tenant.waiting / tenant.weight
        others = [
            (t.waiting / t.weight, name)
            for name, t in self._tenants.items()
            if name != newcomer.claim.tenant and t.waiting
        ]
        heaviest = max(others, key=lambda share: share[0], default=None)
        if heaviest is None or heaviest[0] <= own:
            self._withdraw(newcomer)
            raise self._refuse(
                Saturated, "queue_full", f"{self.in_use} running, {self.waiting} waiting"
            )
        victim = self._newest_of(heaviest[1])
        self._withdraw(victim)
        victim.future.set_exception(
            self._refuse(
                RateLimited, "queue_share",
                f"the queue is full and {_named(victim.claim)} holds more of it than its share",
            )
        )

    def _newest_of(self, tenant: str | None) -> _Waiter:
        """The tenant's newest waiting request of its least urgent priority."""
        for level in reversed(self._levels.values()):
            flow = level.flows.get(tenant)
            if flow is not None and flow.waiting:
                return flow.waiting[-1]
        raise LookupError(f"{tenant!r} has nothing waiting")

    def _timed_out(self, claim: Claim, tenant: _Tenant) -> GatewayError:
        if self._at_limit(claim, tenant):
            return self._refuse(
                RateLimited, "tenant_limit",
                f"{_named(claim)} kept {claim.max_concurrency} running for {self.config.queue_timeout_s} s",
            )
        return self._refuse(Saturated, "queue_timeout", f"no slot within {self.config.queue_timeout_s} s")

    def _refuse(self, kind: type[GatewayError], reason: str, why: str) -> GatewayError:
        self.rejected += 1
        self._signals.rejected(reason)
        what = "its tenant is at its limit" if kind is RateLimited else "the gateway is at capacity"
        error = kind(f"{what} ({why}); retry after {self.config.retry_after_s} s")
        error.headers = {"Retry-After": str(self.config.retry_after_s)}
        return error

    # ------------------------------------------------------------ the queue's discipline

    def _dispatch(self) -> None:
        """Grant slots to waiting requests, in the queue's order, while any are free."""
        while self.capacity is None or self.in_use < self.capacity:
            picked = self._next()
            if picked is None:
                return
            self._grant(*picked)

    def _next(self) -> tuple[_Waiter, float] | None:
        """The next request to serve and its start in virtual time: the most urgent priority
        with a request that may run, then the flow whose head starts first (counting its
        tenant's service in the other processes), then arrival."""
        for level in self._levels.values():
            best: tuple[float, int, _Waiter, float] | None = None
            for flow in level.flows.values():
                if not flow.waiting:
                    continue
                head = flow.waiting[0]
                if head.future.done() or self._at_limit(head.claim, self._tenants[head.claim.tenant]):
                    continue  # cancelled (it leaves when its task runs), or its tenant is at its limit
                start = max(level.virtual, flow.finish)
                order = start + self._elsewhere(flow.tenant)
                if best is None or (order, head.seq) < best[:2]:
                    best = (order, head.seq, head, start)
            if best is not None:
                return best[2], best[3]
        return None

    def _grant(self, waiter: _Waiter, start: float) -> None:
        flow, tenant = waiter.flow, self._tenants[waiter.claim.tenant]
        level = flow.level
        self._unqueue(waiter)
        level.virtual = start
        waiter.charged = tenant.mean_cost
        flow.finish = start + waiter.charged / tenant.weight
        self._charge(waiter.claim.tenant, waiter.charged / tenant.weight)
        waiter.granted = True
        flow.running += 1
        level.running += 1
        tenant.running += 1
        self.in_use += 1
        if not waiter.future.done():
            waiter.future.set_result(None)
        self._signals.waited(level.priority, time.perf_counter() - waiter.since)
        self._signals.in_use(self.in_use, self.capacity)

    def _unqueue(self, waiter: _Waiter) -> None:
        flow = waiter.flow
        flow.waiting.remove(waiter)  # the head, unless it is withdrawn or shed
        waiter.queued = False
        flow.level.waiting -= 1
        self._tenants[waiter.claim.tenant].waiting -= 1
        self.waiting -= 1
        self._signals.queued(flow.level.priority, flow.level.waiting)

    def _withdraw(self, waiter: _Waiter) -> None:
        """A waiting request leaves the queue (timed out, cancelled, shed): it held no slot."""
        if waiter.queued:
            self._unqueue(waiter)
            self._prune(waiter.flow)
            self._dispatch()  # the head it hid (a tenant's FIFO) may run now

    def _release(self, waiter: _Waiter, tokens: int | None) -> None:
        flow, tenant = waiter.flow, self._tenants[waiter.claim.tenant]
        flow.running -= 1
        flow.level.running -= 1
        tenant.running -= 1
        self.in_use -= 1
        if tokens is not None:
            cost = float(max(tokens, 1))
            flow.finish += (cost - waiter.charged) / tenant.weight
            self._charge(waiter.claim.tenant, (cost - waiter.charged) / tenant.weight)
            tenant.mean_cost += MEAN_SMOOTHING * (cost - tenant.mean_cost)
        self._prune(flow)
        self._dispatch()
        self._signals.in_use(self.in_use, self.capacity)

    def _prune(self, flow: _Flow) -> None:
        """A flow with nothing waiting or running, not ahead of its priority's virtual time,
        says nothing a new one would not: it goes. A priority with nothing waiting or running
        goes whole (its flows' history with it), so client-chosen priorities hold no memory."""
        level = flow.level
        if not (flow.waiting or flow.running or flow.finish > level.virtual) and level.flows.get(flow.tenant) is flow:
            del level.flows[flow.tenant]
        if not level.waiting and not level.running and self._levels.get(level.priority) is level:
            del self._levels[level.priority]
            level.flows.clear()  # a flow names its level: left, the pair would wait for the cyclic collector

    def waiting_at(self, priority: int) -> int:
        """Requests of this priority waiting now."""
        level = self._levels.get(priority)
        return level.waiting if level is not None else 0


def _named(claim: Claim) -> str:
    return "the requests without a tenant" if claim.tenant is None else f"tenant {claim.tenant!r}"
