"""vLLM's KV cache event publisher, on the engine's event loop (`zmq.asyncio`).

The wire is `wire.kv_events`': a PUB socket sends `[topic, seq, payload]` per batch, seq
counting from 0; a ROUTER replay socket, when configured, answers a start seq with every
batch still buffered from there, then the END_SEQ frame. Events handed in during one pass
of the event loop go out as one batch, which stands for vLLM's one batch per engine step:
requests whose prefill ends together share it.

Sends never wait: PUB drops what a subscriber past the high-water mark cannot take (as in
vLLM; it can replay), so the generate loop is never held up by a slow reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Literal

import zmq
import zmq.asyncio

from engine.config import KVEventsConfig
from wire.kv_events import END_SEQ, Event, EventBatch, KVEventsError, encode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)


def binds(endpoint: str) -> bool:
    """Whether the engine binds `endpoint` (else it connects to a collector that bound it):
    vLLM's rule (wildcards, `ipc://`, `inproc://`), and a port 0, which only a bind can take."""
    wildcard = "*" in endpoint or "::" in endpoint
    return wildcard or endpoint.startswith(("ipc://", "inproc://")) or endpoint.endswith(":0")


class KVEventPublisher:
    """Batches, numbers, sends and buffers KV events; `start` and `close` own the sockets."""

    def __init__(self, config: KVEventsConfig, encoding: Literal["map", "array"] = "map") -> None:
        self._config = config
        self._encoding = encoding
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._pending: list[Event] = []
        self._flush_scheduled = False
        self._seq = 0
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        """The PUB endpoint, as bound (a port 0 replaced by the one the OS chose)."""
        self.replay_endpoint: str | None = None
        self.dropped = 0
        """Batches the PUB socket refused to queue (never for plain PUB; counted in case)."""

    @property
    def topic(self) -> str:
        return self._config.topic

    async def start(self) -> None:
        """Open the sockets (a second start is a no-op)."""
        if self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(self._config.hwm)
            self.endpoint = _open(self._pub, self._config.endpoint)
            if self._config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_endpoint = _open(self._replay, self._config.replay_endpoint, bind=True)
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        except BaseException:
            await self.close()
            raise
        log.info("KV cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    async def close(self) -> None:
        """Stop replaying and close the sockets without lingering on unsent messages."""
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def publish(self, events: list[Event]) -> None:
        """Queue `events` for this loop pass's batch."""
        if not events or self._pub is None:
            return
        self._pending.extend(events)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending = self._pending, []
        if not events or self._pub is None:
            return
        seq, self._seq = self._seq, self._seq + 1
        payload = encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=0), self._encoding)
        sent = self._pub.send_multipart([self._topic, seq_bytes(seq), payload], flags=zmq.DONTWAIT)
        # A DONTWAIT send settles at once; a refusal is counted, never awaited.
        if isinstance(sent, asyncio.Future) and sent.done() and sent.exception() is not None:
            self.dropped += 1
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        """Answer each `[client, b"", start seq]` with the buffered batches from there, then END_SEQ."""
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or frames[1]:
                log.warning("a KV events replay request of %d frames, not [id, empty, seq]: ignored", len(frames))
                continue
            client, _, start = frames
            try:
                first = seq_of(start)
            except KVEventsError as exc:
                log.warning("a KV events replay request with a bad seq: %s", exc)
                continue
            for seq, payload in list(self._buffer):  # a copy: batches may arrive meanwhile
                if seq >= first:
                    await replay.send_multipart([client, b"", self._topic, seq_bytes(seq), payload])
            await replay.send_multipart([client, b"", b"", END_SEQ, b""])


def _open(socket: zmq.asyncio.Socket, endpoint: str, *, bind: bool | None = None) -> str:
    """Bind or connect `socket`; the endpoint it holds (a bound port 0 resolved)."""
    if bind if bind is not None else binds(endpoint):
        socket.bind(endpoint)
        last = socket.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)
    socket.connect(endpoint)
    return endpoint
