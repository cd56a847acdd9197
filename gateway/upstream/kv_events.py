"""Subscribe to one engine's KV cache events (vLLM's ZMQ publisher) and keep the index current.

One SUB socket per data-parallel rank (rank r publishes on the endpoint's port + r), each
read by a task of its own. Per rank, sequence numbers are tracked:

- the first message sets the baseline (blocks stored before it are unknown: the index
  knows less than the engine holds, which costs a missed affinity, never a wrong one);
- a gap (seq > last + 1): the missing batches are asked of the replay socket (a DEALER to
  vLLM's ROUTER, fresh for each replay, bounded by `replay_timeout_s`) and applied in order;
  without a replay endpoint, or when replay fails, the rank's entries are cleared and it is
  marked stale (a lost removal would leave blocks the engine no longer holds);
- seq going backwards: the engine restarted (vLLM counts from 0 again): the rank's entries
  are cleared and the count starts over; the new run is seen whole, so it is not stale;
- a message that cannot be read (wrong frame count, a seq that is not 8 bytes, a payload
  that is not a batch of known events): counted, logged once a minute per kind, and treated
  as a lost batch (cleared, stale).

A stale rank is fresh again after a restart from 0 or an AllBlocksCleared event (from then on
the index has seen everything). Silence is not staleness: an idle engine publishes nothing,
and ZMQ reconnects a SUB socket by itself, so nothing here times out on quiet.

A flood must not starve the loop: a message already queued is received without yielding,
so the task yields every `batch_limit` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from gateway.config import KV_REPLAY_TIMEOUT_S as REPLAY_TIMEOUT_S
from gateway.config import EngineEndpoint
from gateway.observe.metrics import GatewayMetrics
from gateway.routing.kv_index import KVIndex
from wire.kv_events import END_SEQ, Event, KVEventsError, decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)

BATCH_LIMIT = 64
"""Messages handled between two yields to the event loop (~64 × a batch's apply)."""
RECEIVE_HWM = 100_000
"""As vLLM's publisher's: a rank that falls behind queues this many batches before ZMQ drops."""
LOG_EVERY_S = 60.0


class ReplayFailed(Exception):
    """The replay socket did not return every missing batch in time."""


def rank_endpoint(endpoint: str, rank: int) -> str:
    """`tcp://host:port` of data-parallel rank `rank`: the port plus the rank, as vLLM binds."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


@dataclass
class _Rank:
    rank: int
    endpoint: str
    replay: str | None
    last: int | None = None


@dataclass
class KVSubscriber:
    """Keeps `index` current with the KV cache events of the engine at pool URL `engine`."""

    engine: str
    endpoint: str
    index: KVIndex
    replay: str | None = None
    topic: str = ""
    data_parallel_size: int = 1
    metrics: GatewayMetrics | None = None
    replay_timeout_s: float = REPLAY_TIMEOUT_S
    batch_limit: int = BATCH_LIMIT
    stats: Counter[str] = field(default_factory=Counter)
    """Messages, events by type, errors by reason, replays: what the metrics see, for tests."""
    _context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context.instance)
    _sockets: list[zmq.asyncio.Socket] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _logged: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls, member: EngineEndpoint, index: KVIndex, *, metrics: GatewayMetrics | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> KVSubscriber:
        """The subscriber of a configured engine that has `kv_events` (keyed by its pool URL)."""
        if member.kv_events is None:
            raise ValueError(f"engine {member.url} has no kv_events endpoint")
        return cls(
            engine=member.url.rstrip("/"), endpoint=member.kv_events, index=index, replay=member.kv_replay,
            topic=member.kv_topic, data_parallel_size=member.data_parallel_size, metrics=metrics,
            replay_timeout_s=replay_timeout_s,
        )

    def start(self) -> None:
        """Connect a SUB per rank and start reading; returns at once (ZMQ connects in the background)."""
        for rank in range(self.data_parallel_size):
            state = _Rank(
                rank,
                rank_endpoint(self.endpoint, rank),
                None if self.replay is None else rank_endpoint(self.replay, rank),
            )
            sub = self._socket(zmq.SUB, state.endpoint)
            sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            self._tasks.append(asyncio.create_task(self._read(sub, state), name=f"kv-events {state.endpoint}"))
        self._publish_stale()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._sockets:
            sock.close(linger=0)
        self._tasks.clear()
        self._sockets.clear()

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        if kind == zmq.SUB:
            self._sockets.append(sock)
        return sock

    async def _read(self, sub: zmq.asyncio.Socket, state: _Rank) -> None:
        handled = 0
        while True:
            frames = await sub.recv_multipart()
            try:
                await self._message(state, frames)
            except Exception:  # never out of the task: a bug here must not end the subscription
                log.exception("KV events of %s: a message could not be handled", self.engine)
                self._lost(state, "internal")
            handled += 1
            if handled % self.batch_limit == 0:
                await asyncio.sleep(0)

    async def _message(self, state: _Rank, frames: list[bytes]) -> None:
        seq = self._seq(frames)
        if seq is None:
            state.last = None  # the next message is a new baseline
            self._lost(state, "frames" if len(frames) != 3 else "seq")
            return
        last = state.last
        if last is not None and seq <= last:
            self._count("restart")
            self.index.clear(self.engine, state.rank)
            self.index.mark_fresh(self.engine, state.rank)
        elif last is not None and seq > last + 1:
            await self._gap(state, seq)
        state.last = seq
        self._apply(state, frames[2])

    @staticmethod
    def _seq(frames: list[bytes]) -> int | None:
        if len(frames) != 3:
            return None
        try:
            return seq_of(frames[1])
        except KVEventsError:
            return None

    async def _gap(self, state: _Rank, seq: int) -> None:
        assert state.last is not None
        self._count("gap")
        if state.replay is None:
            self._drop(state, "gap")
            return
        try:
            await self._replay(state, state.last + 1, seq)
        except ReplayFailed as exc:
            self._log("replay_failed", "KV events of %s: replay failed (%s)", self.engine, exc)
            self._lost(state, "replay_failed")
            return
        self._count("replayed")

    async def _replay(self, state: _Rank, start: int, end: int) -> None:
        """Apply batches `start` to `end - 1` from the replay socket, in order."""
        assert state.replay is not None
        dealer = self._socket(zmq.DEALER, state.replay)
        try:
            await dealer.send_multipart([b"", seq_bytes(start)])
            async with asyncio.timeout(self.replay_timeout_s):
                await self._replayed(dealer, state, start, end)
        except TimeoutError as exc:
            raise ReplayFailed(f"no complete answer in {self.replay_timeout_s} s") from exc
        finally:
            dealer.close(linger=0)

    async def _replayed(self, dealer: zmq.asyncio.Socket, state: _Rank, start: int, end: int) -> None:
        expected = start
        while expected < end:
            frames = await dealer.recv_multipart()
            if len(frames) != 4:
                raise ReplayFailed(f"a replay message of {len(frames)} frames")
            if frames[2] == END_SEQ:
                raise ReplayFailed(f"the publisher no longer holds batch {expected}")
            try:
                seq = seq_of(frames[2])
                batch = decode_batch(frames[3])
            except KVEventsError as exc:
                raise ReplayFailed(str(exc)) from exc
            if seq > expected:
                raise ReplayFailed(f"the publisher no longer holds batch {expected} (it answered from {seq})")
            if seq == expected:
                self.index.apply(self.engine, batch.events, state.rank)
                self._counted(batch.events)
                expected += 1
                if (expected - start) % self.batch_limit == 0:
                    await asyncio.sleep(0)

    def _apply(self, state: _Rank, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVEventsError as exc:
            self._log("decode", "KV events of %s: %s", self.engine, exc)
            self._lost(state, "decode")
            return
        self.index.apply(self.engine, batch.events, state.rank)
        self._counted(batch.events)

    def _lost(self, state: _Rank, reason: str) -> None:
        """A batch of this rank was lost: what the index holds of it may be wrong."""
        self._count(reason)
        self._drop(state, reason)

    def _drop(self, state: _Rank, reason: str) -> None:
        self._log(reason, "KV events of %s rank %d: %s; its index entries are dropped", self.engine, state.rank, reason)
        self.index.clear(self.engine, state.rank)
        self.index.mark_stale(self.engine, reason, state.rank)
        self._publish_stale()

    def _counted(self, events: Sequence[Event]) -> None:
        tally = Counter(type(event).__name__ for event in events)
        self.stats.update(tally)
        self.stats["messages"] += 1
        if self.metrics is not None:
            for kind, count in tally.items():
                self.metrics.kv_events.labels(self.engine, kind).inc(count)
            self.metrics.kv_index_blocks.set(self.index.size)
            self._publish_stale()  # an AllBlocksCleared or a restart makes a stale rank fresh

    def _count(self, reason: str) -> None:
        self.stats[reason] += 1
        if self.metrics is None:
            return
        if reason in ("replayed", "replay_failed"):
            self.metrics.kv_replays.labels(self.engine, "ok" if reason == "replayed" else "failed").inc()
        if reason != "replayed":
            self.metrics.kv_event_errors.labels(self.engine, reason).inc()

    def _publish_stale(self) -> None:
        if self.metrics is not None:
            self.metrics.kv_engine_stale.labels(self.engine).set(1 if self.index.is_stale(self.engine) else 0)

    def _log(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[kind] = now
            log.warning(message, *args)
