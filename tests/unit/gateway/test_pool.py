"""The pool's picking and circuit breakers, as pure state machines."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import EngineEndpoint, Health
from gateway.edge.errors import EngineUnavailable
from gateway.upstream.pool import Breaker, Circuit, Pool


def _pool(*urls: str, **health: float) -> tuple[Pool, list[tuple[str, bool]]]:
    events: list[tuple[str, bool]] = []
    pool = Pool(
        [EngineEndpoint(url=u) for u in urls],
        Health(**health),  # type: ignore[arg-type]
        on_circuit=lambda url, is_open: events.append((url, is_open)),
    )
    return pool, events


def _state(breaker: Breaker) -> Circuit:
    """The breaker's state, read afresh: its methods change it, which a type checker's narrowing cannot see."""
    return breaker.state


def test_breaker_opens_after_the_threshold_and_lets_one_trial_through() -> None:
    breaker = Breaker(threshold=3, open_s=5.0)
    for now in (0.0, 0.1):
        breaker.failure(now)
        assert _state(breaker) is Circuit.CLOSED and breaker.admits(now)
    breaker.failure(0.2)
    assert _state(breaker) is Circuit.OPEN
    assert not breaker.admits(1.0) and not breaker.admits(5.1)
    assert breaker.admits(5.3) and _state(breaker) is Circuit.HALF_OPEN  # cooled down: one trial
    breaker.started()
    assert not breaker.admits(5.4)  # only one trial at a time
    breaker.failure(5.5)  # the trial failed: open again, for another open_s
    assert _state(breaker) is Circuit.OPEN and not breaker.admits(10.0) and breaker.admits(10.6)
    breaker.started()
    breaker.success()
    assert _state(breaker) is Circuit.CLOSED and breaker.failures == 0 and breaker.admits(10.7)


def test_a_success_resets_the_failure_count() -> None:
    breaker = Breaker(threshold=2, open_s=1.0)
    breaker.failure(0.0)
    breaker.success()
    breaker.failure(0.1)
    assert breaker.state is Circuit.CLOSED


def test_power_of_two_choices_prefers_the_less_loaded() -> None:
    pool, _ = _pool("http://a", "http://b")
    pool.endpoints["http://a"].outstanding = 5
    assert {pool.pick().url for _ in range(50)} == {"http://b"}


def test_pick_spreads_over_equal_endpoints() -> None:
    pool, _ = _pool("http://a", "http://b", "http://c")
    assert {pool.pick().url for _ in range(200)} == {"http://a", "http://b", "http://c"}


def test_pick_skips_tried_and_open_endpoints_and_says_when_none_is_left() -> None:
    pool, events = _pool("http://a", "http://b", "http://c", failure_threshold=1, open_s=60)
    assert events == [("http://a", False), ("http://b", False), ("http://c", False)]
    pool.failed(pool.endpoints["http://a"])
    assert events[-1] == ("http://a", True)
    assert {pool.pick({"http://b"}).url for _ in range(20)} == {"http://c"}
    with pytest.raises(EngineUnavailable, match="every circuit is open"):
        pool.pick({"http://b", "http://c"})
    pool.succeeded(pool.endpoints["http://a"])  # e.g. a passing health check
    assert events[-1] == ("http://a", False)
    assert pool.pick({"http://b", "http://c"}).url == "http://a"


async def test_resolve_turns_a_host_name_into_its_addresses() -> None:
    pool = Pool([EngineEndpoint(url="http://localhost:8100", resolve=True), EngineEndpoint(url="http://static:1")], Health())
    assert pool.urls() == ["http://static:1"]  # nothing resolved yet
    await pool.resolve()
    assert "http://static:1" in pool.urls()
    assert "http://127.0.0.1:8100" in pool.urls() or "http://[::1]:8100" in pool.urls()


async def test_a_name_that_stops_resolving_keeps_the_pool() -> None:
    pool = Pool([EngineEndpoint(url="http://no-such-host.invalid:8100", resolve=True)], Health())
    pool._set_urls(["http://10.0.0.1:8100"])
    await asyncio.wait_for(pool.resolve(), timeout=10)
    assert pool.urls() == ["http://10.0.0.1:8100"]


def _affinity_pool(count: int) -> Pool:
    from gateway.config import Balancing

    urls = [f"http://e{i}" for i in range(count)]
    return Pool([EngineEndpoint(url=u) for u in urls], Health(), Balancing(mode="prefix_affinity", prefix_tokens=8))


def test_prefix_affinity_keeps_a_prefix_on_one_engine() -> None:
    pool = _affinity_pool(4)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    assert len({pool.pick(prompt=[*shared, i, i + 1]).url for i in range(50)}) == 1  # only the prefix counts
    spread = {pool.pick(prompt=[i, 7, 7, 7, 7, 7, 7, 7]).url for i in range(200)}
    assert len(spread) == 4  # different prefixes land all over the pool


def test_prefix_affinity_bounds_the_load() -> None:
    pool = _affinity_pool(3)
    prompt = [9] * 16
    home = pool.pick(prompt=prompt)
    home.outstanding = 10  # far above the pool's mean (10/3 × 1.25 + 1)
    other = pool.pick(prompt=prompt)
    assert other.url != home.url
    home.outstanding = 1
    assert pool.pick(prompt=prompt).url == home.url  # back under the bound: back home
