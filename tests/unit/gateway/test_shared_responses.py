"""The Responses store of `--workers N`: two stores on one SQLite file stand for two workers."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import msgspec
import pytest

from wire.openai_schema import ChatMessageParam
from gateway.config import ResponseStoreConfig
from gateway.apis.response_store import InProcess, entry_size
from gateway.apis.shared_responses import SharedResponseStore
from gateway.edge.errors import StateUnavailable

A, B = "tenant:a", "tenant:b"


def bounds(**fields: int) -> ResponseStoreConfig:
    big = {"max_entries": 1_000, "max_bytes": 1 << 30, "max_tenant_entries": 1_000, "max_tenant_bytes": 1 << 30}
    return ResponseStoreConfig(**{**big, **fields})


def test_workers_opening_a_new_store_at_once_all_open_it(tmp_path: Path) -> None:
    """Workers start together and open the run's store at once. SQLite answers a journal-mode
    change that meets another connection's lock with "database is locked" at once, past the busy
    timeout: a worker crashed on it at start-up (~4 of these 480 openings failed before the retry)."""
    failures: list[str] = []
    for round_ in range(60):
        path = tmp_path / f"responses-{round_}.sqlite"
        together = threading.Barrier(8)

        def open_store(path: Path = path, together: threading.Barrier = together) -> None:
            together.wait()
            try:
                SharedResponseStore(path).close()
            except sqlite3.OperationalError as exc:
                failures.append(str(exc))

        workers = [threading.Thread(target=open_store) for _ in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert failures == []


def test_what_one_worker_stores_the_other_reads_and_deletes(tmp_path: Path) -> None:
    one, other = SharedResponseStore(tmp_path / "r.sqlite"), SharedResponseStore(tmp_path / "r.sqlite")
    conversation = [ChatMessageParam(role="user", content="hi"), ChatMessageParam(role="assistant", content="hello")]
    assert one.put(A, "resp_a", b'{"id":"resp_a"}', conversation)
    found = other.get(A, "resp_a")
    assert found is not None
    assert bytes(found.response) == b'{"id":"resp_a"}' and found.conversation == conversation
    assert msgspec.json.encode(found.response) == b'{"id":"resp_a"}'
    assert other.delete(A, "resp_a") and one.get(A, "resp_a") is None and not one.delete(A, "resp_a")


def test_another_owner_finds_nothing_in_any_worker(tmp_path: Path) -> None:
    one, other = SharedResponseStore(tmp_path / "r.sqlite"), SharedResponseStore(tmp_path / "r.sqlite")
    one.put(A, "resp_a", b'{"id":"resp_a"}', [])
    assert other.get(B, "resp_a") is None and not other.delete(B, "resp_a") and one.get(B, "resp_a") is None
    assert other.get(A, "resp_a") is not None


def test_shared_store_evicts_the_least_recently_used_beyond_its_count(tmp_path: Path) -> None:
    one = SharedResponseStore(tmp_path / "r.sqlite", bounds(max_entries=2, max_tenant_entries=2))
    other = SharedResponseStore(tmp_path / "r.sqlite", bounds(max_entries=2, max_tenant_entries=2))
    one.put(A, "a", b'{"id":"a"}', [])
    other.put(A, "b", b'{"id":"b"}', [])
    assert other.get(A, "a") is not None  # a is now the more recent, whoever read it
    one.put(A, "c", b'{"id":"c"}', [])
    assert (one.get(A, "a") is not None, one.get(A, "b"), one.get(A, "c") is not None, len(other)) == (True, None, True, 2)


def test_shared_store_is_bounded_in_bytes(tmp_path: Path) -> None:
    one = entry_size(b"x" * 100, b"[]")  # counted as the in-memory store counts
    store = SharedResponseStore(tmp_path / "r.sqlite", bounds(max_bytes=2 * one + 50, max_tenant_bytes=2 * one + 50))
    assert store.put(A, "a", b"x" * 100, []) and store.put(A, "b", b"x" * 100, [])
    store.put(A, "c", b"x" * 100, [])
    assert store.get(A, "a") is None and len(store) == 2
    assert not store.put(A, "huge", b"x" * 3 * one, []) and store.get(A, "huge") is None and len(store) == 2
    store.put(A, "b", b"x" * 10, [])  # replaced, not kept twice
    assert len(store) == 2 and store.get(A, "b") is not None


def test_an_owner_past_its_share_evicts_its_own_oldest_in_every_worker(tmp_path: Path) -> None:
    one = entry_size(b"x" * 1000, b"[]")
    config = bounds(max_bytes=10 * one, max_tenant_bytes=3 * one, max_entries=10, max_tenant_entries=4)
    first, second = SharedResponseStore(tmp_path / "r.sqlite", config), SharedResponseStore(tmp_path / "r.sqlite", config)
    first.put(A, "a", b"x" * 1000, [])
    for index in range(20):  # B's many large answers, through either worker
        assert (first, second)[index % 2].put(B, f"b{index}", b"x" * 1000, [])
    assert second.get(A, "a") is not None
    assert [first.get(B, f"b{index}") is not None for index in range(16, 20)] == [False, True, True, True]
    for index in range(30):  # small ones: the count share binds first
        second.put(B, f"s{index}", b"{}", [])
    assert first.get(A, "a") is not None and len(first) == 5


def test_a_stored_session_is_read_back_in_every_worker(tmp_path: Path) -> None:
    from gateway.apis.response_store import ResponseStore

    one, other = SharedResponseStore(tmp_path / "r.sqlite"), SharedResponseStore(tmp_path / "r.sqlite")
    for writer, reader in ((one, other), (ResponseStore(), None)):
        writer.put(A, "resp_s", b"{}", [], session="conv-1")
        writer.put(A, "resp_n", b"{}", [])
        source = reader or writer
        assert [source.get(A, r).session for r in ("resp_s", "resp_n")] == ["conv-1", None]  # type: ignore[union-attr]


async def test_a_read_waits_for_no_writer_and_a_blocked_write_is_state_unavailable_in_its_time(tmp_path: Path) -> None:
    """Another worker holds the write lock: a read is answered at once (its use not counted),
    a write gives up within `state.timeout_s` as a 503, and neither blocks the event loop."""
    path = tmp_path / "r.sqlite"
    store = InProcess(SharedResponseStore(path, busy_timeout_s=0.2), timeout_s=0.3)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        assert await store.put(A, "a", b'{"id":"a"}', [])
        other.execute("BEGIN IMMEDIATE")
        ticks = 0

        async def tick() -> None:  # the loop keeps turning while the store waits
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(tick())
        async with asyncio.timeout(2.0):
            found = await store.get(A, "a")
            assert found is not None and bytes(found.response) == b'{"id":"a"}'
            with pytest.raises(StateUnavailable):
                await store.put(A, "b", b'{"id":"b"}', [])
        ticking.cancel()
        assert ticks > 10
        other.execute("ROLLBACK")
        assert await store.put(A, "b", b'{"id":"b"}', []) and await store.get(A, "b") is not None
    finally:
        other.close()
        await store.close()
