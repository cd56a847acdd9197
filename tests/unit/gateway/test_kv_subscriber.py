"""The KV events subscriber against real ZMQ sockets on loopback: a test publisher (PUB) and
a replay socket (ROUTER) that answer as vLLM's do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.observe.metrics import GatewayMetrics
from gateway.routing.kv_index import KVIndex
from gateway.upstream.kv_events import KVSubscriber, rank_endpoint
from tests.support.waiting import wait_until
from wire.kv_events import END_SEQ, AllBlocksCleared, BlockStored, EventBatch, encode_batch, seq_bytes, seq_of

ENGINE = "http://engine:8000"
BS = 4
TOPIC = b"kv"
JOIN_TIMEOUT_S = 10.0
JOIN_TIMEOUT_MS = 10_000


def block(i: int) -> list[int]:
    return [i * 10 + t for t in range(BS)]


def prompt(blocks: int) -> list[int]:
    return [t for i in range(blocks) for t in block(i)]


def stored_batch(i: int) -> EventBatch:
    """Block i of one long prompt, chained on block i - 1 (engine hash = 1000 + i)."""
    parent = None if i == 0 else 1000 + i - 1
    event = BlockStored(block_hashes=[1000 + i], parent_block_hash=parent, token_ids=block(i), block_size=BS)
    return EventBatch(ts=0.0, events=[event])


@dataclass
class Publisher:
    """vLLM's publisher's wire: PUB `[topic, seq, payload]`; ROUTER replay of what it sent."""

    pub: zmq.asyncio.Socket
    router: zmq.asyncio.Socket | None
    endpoint: str
    replay: str | None
    sent: list[tuple[int, bytes]] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def send(self, seq: int, payload: bytes, *, deliver: bool = True) -> None:
        """`deliver=False`: kept for replay but never published (a message the subscriber missed)."""
        self.sent.append((seq, payload))
        if deliver:
            await self.pub.send_multipart([TOPIC, seq_bytes(seq), payload])

    async def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            self.served.append(seq_of(start))
            for seq, payload in self.sent:
                if seq >= seq_of(start):
                    await self.router.send_multipart([client, b"", TOPIC, seq_bytes(seq), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


def bind(sock: zmq.asyncio.Socket) -> str:
    sock.bind("tcp://127.0.0.1:0")
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


@pytest.fixture
async def publisher(request: pytest.FixtureRequest) -> AsyncIterator[Publisher]:
    context = zmq.asyncio.Context.instance()
    pub = context.socket(zmq.XPUB)  # a PUB on the wire that also tells when a subscriber has joined
    pub.setsockopt(zmq.SNDHWM, 100_000)
    endpoint = bind(pub)
    with_replay = getattr(request, "param", True)
    router = context.socket(zmq.ROUTER) if with_replay else None
    replay = bind(router) if router is not None else None
    publisher = Publisher(pub, router, endpoint, replay)
    if router is not None:
        publisher.task = asyncio.create_task(publisher.serve_replay())
    yield publisher
    if publisher.task is not None:
        publisher.task.cancel()
    pub.close(linger=0)
    if router is not None:
        router.close(linger=0)


async def subscribed(publisher: Publisher, index: KVIndex, **options: object) -> KVSubscriber:
    """A started subscriber that has joined: the XPUB saw its subscription (a SUB connects in the
    background and misses what is published before it has)."""
    subscriber = KVSubscriber(ENGINE, publisher.endpoint, index, replay=publisher.replay, topic="kv", **options)  # type: ignore[arg-type]
    subscriber.start()
    assert await asyncio.wait_for(publisher.pub.recv(), JOIN_TIMEOUT_S) == b"\x01" + TOPIC
    return subscriber


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_events_reach_the_index(publisher: Publisher, encoding: Literal["map", "array"]) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    try:
        for i in range(3):
            await publisher.send(1 + i, encode_batch(stored_batch(i), encoding))
        await wait_until(lambda: index.match(prompt(3)) == {ENGINE: 3}, what="three blocks indexed")
        assert subscriber.stats["BlockStored"] == 3 and not index.is_stale(ENGINE)
    finally:
        await subscriber.close()


async def test_a_match_applies_what_the_subscriber_has_received_before_it_drains(publisher: Publisher) -> None:
    """A busy rank is drained every `gather_s` (here longer than the test): a routing
    decision sees each batch received all the same; a quiet one's batch is applied on arrival."""
    index = KVIndex(block_size=BS)
    metrics = GatewayMetrics()
    subscriber = await subscribed(publisher, index, gather_s=3600.0, metrics=metrics)
    try:
        await publisher.send(1, encode_batch(stored_batch(0)))
        await wait_until(lambda: index.size == 1, what="a quiet engine's batch applied on arrival")
        for i in (1, 2):  # now within gather_s of the last drain: left queued for the next
            await publisher.send(1 + i, encode_batch(stored_batch(i)))
        assert index.size == 1
        await wait_until(lambda: index.match(prompt(3)) == {ENGINE: 3}, what="three blocks matched")
        assert subscriber.stats["messages"] == 3 and index.size == 3
        assert metrics.kv_events.labels(ENGINE, "BlockStored")._value.get() == 3
    finally:
        await subscriber.close()
    assert index.match(prompt(3)) == {ENGINE: 3}  # a closed subscription is no longer asked


async def test_a_missed_message_is_replayed(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    try:
        await publisher.send(1, encode_batch(stored_batch(0)))
        await publisher.send(2, encode_batch(stored_batch(1)), deliver=False)
        await publisher.send(3, encode_batch(stored_batch(2)))
        await wait_until(lambda: index.match(prompt(3)) == {ENGINE: 3}, what="the gap repaired")
        assert publisher.served == [2]
        assert subscriber.stats["replayed"] == 1 and not index.is_stale(ENGINE)
        await publisher.send(4, encode_batch(stored_batch(3)))  # and the run goes on from there
        await wait_until(lambda: index.match(prompt(4)) == {ENGINE: 4}, what="the next block")
    finally:
        await subscriber.close()


@pytest.mark.parametrize("publisher", [False], indirect=True)
async def test_without_replay_a_gap_clears_and_marks_stale(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    metrics = GatewayMetrics()
    subscriber = await subscribed(publisher, index, metrics=metrics)
    try:
        await publisher.send(1, encode_batch(stored_batch(0)))
        await wait_until(lambda: index.size == 1, what="block 0 indexed")
        await publisher.send(3, encode_batch(stored_batch(2)))  # 2 never arrives
        await wait_until(lambda: index.is_stale(ENGINE), what="stale")
        assert index.size == 0 and index.ignored["unknown_parent"] == 1  # block 2's parent was cleared
        assert metrics.kv_engine_stale.labels(ENGINE)._value.get() == 1
        assert metrics.kv_event_errors.labels(ENGINE, "gap")._value.get() == 1
        # The engine's cache is reset: everything from here on is seen, so it is fresh again.
        await publisher.send(4, encode_batch(EventBatch(ts=0.0, events=[AllBlocksCleared()])))
        await wait_until(lambda: not index.is_stale(ENGINE), what="fresh after AllBlocksCleared")
        assert metrics.kv_engine_stale.labels(ENGINE)._value.get() == 0
    finally:
        await subscriber.close()


async def test_a_replay_that_no_longer_holds_the_batches_fails_to_stale(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    try:
        await publisher.send(1, encode_batch(stored_batch(0)))
        publisher.sent.clear()  # the publisher's buffer has moved on
        await publisher.send(5, encode_batch(stored_batch(4)))
        await wait_until(lambda: subscriber.stats["replay_failed"] == 1, what="the replay failed")
        assert index.is_stale(ENGINE) and index.size == 0
    finally:
        await subscriber.close()


async def test_seq_going_backwards_is_a_restart(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    try:
        await publisher.send(7, encode_batch(stored_batch(0)))
        await wait_until(lambda: index.size == 1, what="block 0 indexed")
        await publisher.send(0, encode_batch(stored_batch(5)))  # the engine's new run: a chain the index cannot follow
        await wait_until(lambda: subscriber.stats["restart"] == 1, what="the restart seen")
        assert index.size == 0 and not index.is_stale(ENGINE)
        await publisher.send(1, encode_batch(stored_batch(0)))
        await wait_until(lambda: index.size == 1, what="the new run indexed")
        assert subscriber.stats["gap"] == 0
    finally:
        await subscriber.close()


async def test_garbage_is_counted_and_never_ends_the_subscription(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    try:
        await publisher.pub.send_multipart([TOPIC, seq_bytes(1), b"\x93\xcb"])  # truncated msgpack
        unknown = msgspec.msgpack.encode([0.0, [{"type": "BlockMoved", "block_hashes": [1]}], None])
        await publisher.pub.send_multipart([TOPIC, seq_bytes(2), unknown])
        await publisher.pub.send_multipart([TOPIC, b"\x01", b""])  # a seq of one byte
        await publisher.pub.send_multipart([TOPIC, seq_bytes(4)])  # two frames
        await publisher.pub.send_multipart([TOPIC, seq_bytes(5), encode_batch(stored_batch(0))])
        await wait_until(lambda: index.size == 1, what="a good batch after the garbage")
        assert subscriber.stats["decode"] == 2 and subscriber.stats["seq"] == 1 and subscriber.stats["frames"] == 1
        assert index.is_stale(ENGINE)
        assert all(not task.done() for task in subscriber._tasks)
    finally:
        await subscriber.close()


def queue_flood(publisher: Publisher, payloads: list[bytes]) -> None:
    """Publish every payload and return once a witness SUB has them all, without letting the
    event loop run: the subscriber then finds the whole flood queued at once."""
    publisher.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    witness: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    witness.setsockopt(zmq.RCVHWM, 2 * len(payloads))
    witness.setsockopt(zmq.SUBSCRIBE, TOPIC)
    witness.connect(publisher.endpoint)
    pub: zmq.Socket[bytes] = zmq.Socket.shadow(publisher.pub.underlying)
    try:
        assert pub.poll(JOIN_TIMEOUT_MS) and pub.recv() == b"\x01" + TOPIC
        for seq, payload in enumerate(payloads, start=1):
            pub.send_multipart([TOPIC, seq_bytes(seq), payload])
        for _ in payloads:
            assert witness.poll(JOIN_TIMEOUT_MS), "the flood did not arrive"
            witness.recv_multipart()
    finally:
        witness.close(linger=0)


async def test_a_flood_does_not_starve_other_tasks(publisher: Publisher) -> None:
    index = KVIndex(block_size=BS)
    subscriber = await subscribed(publisher, index)
    flood = 10_000
    seen: set[int] = set()

    async def watcher() -> None:
        """Another task: notes how far the flood had got each time it ran."""
        while True:
            seen.add(subscriber.stats["BlockStored"])
            await asyncio.sleep(0)

    queue_flood(publisher, [encode_batch(stored_batch(i)) for i in range(flood)])
    watching = asyncio.create_task(watcher())
    try:
        await wait_until(lambda: subscriber.stats["BlockStored"] == flood, timeout=60, what="the whole flood applied")
        assert index.match(prompt(flood)) == {ENGINE: flood}
        # The watcher ran between the subscriber's bounded batches, not only before and after the flood.
        during = [count for count in seen if 0 < count < flood]
        assert len(during) >= flood // subscriber.batch_limit // 2
    finally:
        watching.cancel()
        await subscriber.close()


async def test_data_parallel_ranks_subscribe_on_port_plus_rank() -> None:
    context = zmq.asyncio.Context.instance()
    pubs = [context.socket(zmq.XPUB) for _ in range(2)]
    base = bind(pubs[0])
    try:
        pubs[1].bind(rank_endpoint(base, 1))
    except zmq.ZMQError:
        for pub in pubs:  # closed before the skip: an unclosed socket's warning fails the teardown
            pub.close(linger=0)
        pytest.skip("the port after a free one is taken")
    index = KVIndex(block_size=BS)
    subscriber = KVSubscriber(ENGINE, base, index, data_parallel_size=2)
    subscriber.start()
    try:
        for pub in pubs:
            assert await asyncio.wait_for(pub.recv(), JOIN_TIMEOUT_S) == b"\x01"
        await pubs[1].send_multipart([b"", seq_bytes(1), encode_batch(stored_batch(0))])
        await wait_until(lambda: index.match(prompt(1)) == {ENGINE: 1}, what="rank 1's block")
        index.clear(ENGINE, rank=0)
        assert index.match(prompt(1)) == {ENGINE: 1}
        index.clear(ENGINE, rank=1)
        assert index.match(prompt(1)) == {}
    finally:
        await subscriber.close()
        for pub in pubs:
            pub.close(linger=0)
