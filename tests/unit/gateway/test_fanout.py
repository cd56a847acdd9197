"""The pipeline's fan-out: several engine requests' streams merged at the reader's pace."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from gateway.flow.pipeline import all_of, merged


class _Source:
    """A stream that counts what it produced and whether it was closed."""

    def __init__(self, name: str, items: int, fail_at: int | None = None) -> None:
        self.name = name
        self.items = items
        self.fail_at = fail_at
        self.produced = 0
        self.closed = False

    async def stream(self) -> AsyncGenerator[str, None]:
        try:
            for i in range(self.items):
                if i == self.fail_at:
                    raise ValueError(f"{self.name} broke")
                self.produced += 1
                yield f"{self.name}{i}"
                await asyncio.sleep(0)
        finally:
            self.closed = True


async def test_every_item_arrives_once_in_each_streams_order() -> None:
    sources = [_Source("a", 50), _Source("b", 30), _Source("c", 0)]
    out = [item async for item in merged([s.stream() for s in sources])]
    assert sorted(out) == sorted(f"{s.name}{i}" for s in sources for i in range(s.items))
    for source in sources:
        mine = [item for item in out if item.startswith(source.name)]
        assert mine == [f"{source.name}{i}" for i in range(source.items)]
    assert all(source.closed for source in sources)


async def test_a_slow_reader_holds_the_streams_back() -> None:
    """Backpressure: at most one unread item per stream waits, however fast the streams are."""
    sources = [_Source("a", 1000), _Source("b", 1000)]
    stream = merged([s.stream() for s in sources])
    read = 0
    async for _ in stream:
        read += 1
        await asyncio.sleep(0.001)  # the client is slower than its engines
        produced = sum(s.produced for s in sources)
        assert produced <= read + len(sources) + len(sources), (produced, read)
        if read == 50:
            break
    await stream.aclose()
    assert all(source.closed for source in sources)


async def test_the_first_failure_ends_the_merge_and_stops_the_other_streams() -> None:
    sources = [_Source("a", 10_000), _Source("b", 10, fail_at=3)]
    got: list[str] = []
    with pytest.raises(ValueError, match="b broke"):
        async for item in merged([s.stream() for s in sources]):
            got.append(item)
    assert "b2" in got and "b3" not in got
    assert all(source.closed for source in sources)
    assert sources[0].produced < 10_000


async def test_all_of_keeps_order_and_cancels_the_rest_on_a_failure() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await all_of([value(1, 0.02), value(2, 0.0), value(3, 0.01)]) == [1, 2, 3]

    cancelled = asyncio.Event()

    async def slow() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async def broken() -> int:
        await asyncio.sleep(0.01)
        raise KeyError("gone")

    with pytest.raises(KeyError):
        await all_of([slow(), broken()])
    assert cancelled.is_set()
