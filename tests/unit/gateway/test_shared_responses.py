"""The Responses store of `--workers N`: two stores on one SQLite file stand for two workers."""

from __future__ import annotations

from pathlib import Path

import msgspec

from engine.openai_schema import ChatMessageParam
from gateway.shared_responses import SharedResponseStore


def test_what_one_worker_stores_the_other_reads_and_deletes(tmp_path: Path) -> None:
    one, other = SharedResponseStore(tmp_path / "r.sqlite"), SharedResponseStore(tmp_path / "r.sqlite")
    conversation = [ChatMessageParam(role="user", content="hi"), ChatMessageParam(role="assistant", content="hello")]
    assert one.put("resp_a", b'{"id":"resp_a"}', conversation)
    found = other.get("resp_a")
    assert found is not None
    assert bytes(found.response) == b'{"id":"resp_a"}' and found.conversation == conversation  # type: ignore[arg-type]
    assert msgspec.json.encode(found.response) == b'{"id":"resp_a"}'
    assert other.delete("resp_a") and one.get("resp_a") is None and not one.delete("resp_a")


def test_shared_store_evicts_the_least_recently_used_beyond_its_count(tmp_path: Path) -> None:
    one = SharedResponseStore(tmp_path / "r.sqlite", max_entries=2)
    other = SharedResponseStore(tmp_path / "r.sqlite", max_entries=2)
    one.put("a", b'{"id":"a"}', [])
    other.put("b", b'{"id":"b"}', [])
    assert other.get("a") is not None  # a is now the more recent, whoever read it
    one.put("c", b'{"id":"c"}', [])
    assert (one.get("a") is not None, one.get("b"), one.get("c") is not None, len(other)) == (True, None, True, 2)


def test_shared_store_is_bounded_in_bytes(tmp_path: Path) -> None:
    store = SharedResponseStore(tmp_path / "r.sqlite", max_bytes=250)
    assert store.put("a", b"x" * 100, []) and store.put("b", b"x" * 100, [])  # 102 bytes each, with "[]"
    store.put("c", b"x" * 100, [])
    assert store.get("a") is None and len(store) == 2
    assert not store.put("huge", b"x" * 300, []) and store.get("huge") is None and len(store) == 2
    store.put("b", b"x" * 10, [])  # replaced, not kept twice
    assert len(store) == 2 and store.get("b") is not None
