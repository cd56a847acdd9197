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

Reading costs little per batch, since a listening gateway hears every engine's every
prefill. Each SUB is a plain (blocking-API) socket read with non-blocking receives: a
rank's task waits on the socket's file descriptor and drains the queue when woken; woken
again within `gather_s` of its last drain, it drains every `gather_s` instead, until a
drain finds nothing (a `zmq.asyncio` receive costs a future and a reader registered and
removed per message, and a batch applied after a sleep finds the caches cold: a busy
engine's batches are cheaper applied together). The index calls `catch_up` before each match, which applies what is
queued, so a routing decision sees every batch received, as if each were applied on
arrival. A flood must not starve the loop: the task yields every `batch_limit` messages,
and a catch-up applies at most `catch_up_limit` an engine. Metrics are per batch, not per
event, through label children looked up once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Counter as CounterChild

from gateway.config import KV_REPLAY_TIMEOUT_S as REPLAY_TIMEOUT_S
from gateway.config import EngineEndpoint
from gateway.observe.metrics import GatewayMetrics
from gateway.routing.kv_index import KVIndex
from wire.kv_events import END_SEQ, AllBlocksCleared, Event, KVEventsError, decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)

GATHER_S = 0.1
"""While an engine is busy (a message within this long of the last drain), its messages
are drained this often rather than one wake-up each: a batch applied after the process
slept costs about twice one applied right after another (caches cold), and a match
applies what is queued first (`catch_up`), so routing never sees the index this much
behind."""
BATCH_LIMIT = 64
"""Messages handled between two yields to the event loop (~64 × a batch's apply)."""
CATCH_UP_LIMIT = 16
"""Messages of one engine a match applies at most (more are queued only in a flood, which
the ranks' tasks work through in bounded batches)."""
RECEIVE_HWM = 100_000
"""As vLLM's publisher's: a rank that falls behind queues this many batches before ZMQ drops."""
LOG_EVERY_S = 60.0


class ReplayFailed(Exception):
    """The replay socket did not return every missing batch in time."""


def rank_endpoint(endpoint: str, rank: int) -> str:
    """`tcp://host:port` of data-parallel rank `rank`: the port plus the rank, as vLLM binds."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _connect(sock: zmq.Socket[Any], endpoint: str) -> None:
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(endpoint)


class _Readable:
    """Waits, without a wake-up per message, until a ZMQ socket has a message queued.

    ZMQ's file descriptor is a signal, not a queue: it turns readable when the socket's state
    may have changed, and stays so until `EVENTS` is read. So the wait reads `EVENTS` first
    (a message may be queued already), and each signal reads it again; the descriptor is
    watched only while waiting (a busy socket is drained on a timer instead, not woken by
    every message)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self._waiter: asyncio.Future[None] | None = None

    def _ready(self) -> bool:
        return bool(int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _signalled(self) -> None:
        if self._ready() and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def wake(self) -> None:
        """End a wait without a message queued (another reader left one for this task)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Returns once a message is queued (or `wake`)."""
        if self._ready():
            return
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        loop.add_reader(self._fd, self._signalled)
        try:
            if not self._ready():  # one may have come before the descriptor was watched
                await self._waiter
        finally:
            loop.remove_reader(self._fd)
            self._waiter = None


@dataclass
class _Rank:
    rank: int
    endpoint: str
    replay: str | None
    sub: zmq.Socket[bytes]
    readable: _Readable
    last: int | None = None
    held: list[bytes] | None = None
    """A message `catch_up` received that opens a gap: the rank's task replays, then applies it."""
    replaying: bool = False


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
    gather_s: float = GATHER_S
    catch_up_limit: int = CATCH_UP_LIMIT
    stats: Counter[str] = field(default_factory=Counter)
    """Messages, events by type, errors by reason, replays: what the metrics see, for tests."""
    _context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context.instance)
    _ranks: list[_Rank] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _logged: dict[str, float] = field(default_factory=dict)
    _event_counters: dict[str, CounterChild] = field(default_factory=dict)

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
            endpoint = rank_endpoint(self.endpoint, rank)
            sub: zmq.Socket[bytes] = zmq.Socket(self._context, zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            _connect(sub, endpoint)
            replay = None if self.replay is None else rank_endpoint(self.replay, rank)
            state = _Rank(rank, endpoint, replay, sub, _Readable(sub))
            self._ranks.append(state)
            self._tasks.append(asyncio.create_task(self._read(state), name=f"kv-events {endpoint}"))
        self.index.add_catch_up(self.catch_up)
        self._publish_stale()

    async def close(self) -> None:
        self.index.remove_catch_up(self.catch_up)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for state in self._ranks:
            state.sub.close(linger=0)
        self._tasks.clear()
        self._ranks.clear()

    def catch_up(self) -> None:
        """Apply what the ranks have queued, up to `catch_up_limit` messages in all (the index
        calls it before a match, so that a routing decision sees every batch received while
        the ranks' tasks gather). A rank in a replay is left to it, and a message that opens
        a gap is handed to the rank's task, which replays first."""
        budget = self.catch_up_limit
        for state in self._ranks:
            if state.replaying or state.held is not None:
                continue
            while budget > 0:
                try:
                    frames = state.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                budget -= 1
                if not self._guarded(state, frames):
                    state.held = frames
                    state.readable.wake()
                    break

    async def _read(self, state: _Rank) -> None:
        loop = asyncio.get_running_loop()
        drained = -self.gather_s
        while True:
            await state.readable.wait()  # no wake-up until a message is queued
            if loop.time() - drained >= self.gather_s:  # the engine was quiet: a wake-up a message
                await self._drain(state)
            else:  # busy: its next batches queue behind the first, drained together
                while True:
                    await asyncio.sleep(self.gather_s)
                    if not await self._drain(state):
                        break  # none came meanwhile: quiet again
            drained = loop.time()

    async def _drain(self, state: _Rank) -> bool:
        """Handle every message queued, yielding every `batch_limit`; whether there was one."""
        handled = 0
        while True:
            frames, state.held = state.held, None
            if frames is None:
                try:
                    frames = state.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return handled > 0
            if not self._guarded(state, frames):
                await self._replay_then_apply(state, frames)
            handled += 1
            if handled % self.batch_limit == 0:
                await asyncio.sleep(0)

    def _guarded(self, state: _Rank, frames: list[bytes]) -> bool:
        """`_message`, never raising: a bug here must not end the subscription (nor a match)."""
        try:
            return self._message(state, frames)
        except Exception:
            log.exception("KV events of %s: a message could not be handled", self.engine)
            self._lost(state, "internal")
            return True

    async def _replay_then_apply(self, state: _Rank, frames: list[bytes]) -> None:
        """A message that opened a gap: the missing batches from the replay socket, then it."""
        seq = seq_of(frames[1])
        state.replaying = True
        try:
            await self._gap(state, seq)
            state.last = seq
            self._apply(state, frames[2])
        except Exception:
            log.exception("KV events of %s: a message could not be handled", self.engine)
            self._lost(state, "internal")
        finally:
            state.replaying = False

    def _message(self, state: _Rank, frames: list[bytes]) -> bool:
        """One message, unless it opens a gap that the replay socket may fill: then False,
        and nothing done (the replay awaits)."""
        seq = self._seq(frames)
        if seq is None:
            state.last = None  # the next message is a new baseline
            self._lost(state, "frames" if len(frames) != 3 else "seq")
            return True
        last = state.last
        if last is not None and seq <= last:
            self._count("restart")
            self.index.clear(self.engine, state.rank)
            self.index.mark_fresh(self.engine, state.rank)
            self._publish_stale()
        elif last is not None and seq > last + 1:
            if state.replay is not None:
                return False
            self._count("gap")
            self._drop(state, "gap")
        state.last = seq
        self._apply(state, frames[2])
        return True

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
        dealer = self._context.socket(zmq.DEALER)
        _connect(dealer, state.replay)
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
        tally: dict[type, int] = {}
        for event in events:
            kind = type(event)
            tally[kind] = tally.get(kind, 0) + 1
        stats = self.stats
        for kind, count in tally.items():
            stats[kind.__name__] += count
        stats["messages"] += 1
        if self.metrics is not None:
            for kind, count in tally.items():
                self._event_counter(kind.__name__).inc(count)
            self.metrics.kv_index_blocks.set(self.index.size)
            if AllBlocksCleared in tally:
                self._publish_stale()  # the engine's cache is empty and seen so: a stale rank is fresh

    def _event_counter(self, kind: str) -> CounterChild:
        """The `kv_events` child of this engine and event type (`labels` costs a lock and a lookup a call)."""
        child = self._event_counters.get(kind)
        if child is None:
            assert self.metrics is not None
            child = self._event_counters[kind] = self.metrics.kv_events.labels(self.engine, kind)
        return child

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
