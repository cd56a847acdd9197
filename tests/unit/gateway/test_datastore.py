"""The pool's datastore: circuit breakers, membership, sessions, routes turned off."""

from __future__ import annotations

import asyncio

from gateway.config import EngineEndpoint, Health
from gateway.routing.datastore import ROUTES_OFF_RECHECK_S, Breaker, Circuit, EndpointStore


def _store(*urls: str, **health: float) -> tuple[EndpointStore, list[tuple[str, bool]]]:
    events: list[tuple[str, bool]] = []
    store = EndpointStore(
        [EngineEndpoint(url=u) for u in urls],
        Health(**health),  # type: ignore[arg-type]
        on_circuit=lambda url, is_open: events.append((url, is_open)),
    )
    return store, events


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


def test_failures_open_the_circuit_and_a_success_closes_it_telling_the_gauge() -> None:
    store, events = _store("http://a", "http://b", failure_threshold=2, open_s=60)
    assert events == [("http://a", False), ("http://b", False)]
    store.failed(store.endpoints["http://a"], 0.0)
    assert store.endpoints["http://a"].breaker.state is Circuit.CLOSED and len(events) == 2
    store.failed(store.endpoints["http://a"], 0.1)
    assert events[-1] == ("http://a", True)
    store.succeeded(store.endpoints["http://a"])  # e.g. a passing health check
    assert events[-1] == ("http://a", False)


def test_sessions_are_remembered_per_tenant_and_bounded() -> None:
    store, _ = _store("http://a", "http://b")
    store.max_sessions = 2
    store.remember_session("acme", "s1", "http://a")
    store.remember_session("globex", "s1", "http://b")
    assert store.session_engine("acme", "s1") == "http://a" and store.session_engine("globex", "s1") == "http://b"
    assert store.session_engine(None, "s1") is None  # another tenant's (or no tenant's) key is another session
    store.remember_session("acme", "s1", "http://b")  # the latest turn's engine, and the most recent
    store.remember_session("acme", "s2", "http://a")  # over the bound: the least recent (globex's) goes
    assert store.session_engine("globex", "s1") is None
    assert store.session_engine("acme", "s1") == "http://b" and store.session_engine("acme", "s2") == "http://a"


def test_an_engine_refusing_the_generate_api_is_off_for_a_while() -> None:
    store, _ = _store("http://a")
    endpoint = store.endpoints["http://a"]
    assert not endpoint.off(100.0)
    endpoint.off_at = 100.0
    assert endpoint.off(100.0 + ROUTES_OFF_RECHECK_S - 1) and not endpoint.off(100.0 + ROUTES_OFF_RECHECK_S)


async def test_resolve_turns_a_host_name_into_its_addresses() -> None:
    members = [EngineEndpoint(url="http://localhost:8100", resolve=True), EngineEndpoint(url="http://static:1")]
    store = EndpointStore(members, Health())
    assert store.urls() == ["http://static:1"]  # nothing resolved yet
    await store.resolve()
    assert "http://static:1" in store.urls()
    assert "http://127.0.0.1:8100" in store.urls() or "http://[::1]:8100" in store.urls()


async def test_a_name_that_stops_resolving_keeps_the_pool() -> None:
    store = EndpointStore([EngineEndpoint(url="http://no-such-host.invalid:8100", resolve=True)], Health())
    store._set_urls(["http://10.0.0.1:8100"])
    await asyncio.wait_for(store.resolve(), timeout=10)
    assert store.urls() == ["http://10.0.0.1:8100"]
