"""The client watch on real loopback sockets: what the kernel says a client took, and a client
cut for taking nothing while one that keeps taking, however slowly, is not."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.relay.client_watch import ClientWatch, tcp_progress

STALL_S = 0.5
GUARD_S = 20 * STALL_S
PAYLOAD = b"x" * 65536


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[asyncio.Transport, socket.socket]]:
    """(the server side's transport, a blocking client socket with a small receive buffer)."""
    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)  # type: ignore[arg-type]

    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(server.sockets[0].getsockname())
    transport = await asyncio.wait_for(accepted, GUARD_S)
    try:
        yield transport, client
    finally:
        transport.abort()
        client.close()
        server.close()
        await server.wait_closed()


async def _progress_until(sock: socket.socket, done: Callable[[tuple[int, bool]], bool]) -> tuple[int, bool]:
    """The kernel's answer once `done` says so (its ACKs may lag the reads a little)."""
    async with asyncio.timeout(GUARD_S):
        while True:
            progress = tcp_progress(sock)
            assert progress is not None
            if done(progress):
                return progress
            await asyncio.sleep(0.01)


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's layout is Linux's")
async def test_the_kernel_says_what_the_client_took_and_whether_bytes_wait_for_it() -> None:
    async with connected() as (transport, client):
        sock = transport.get_extra_info("socket")
        start, _ = await _progress_until(sock, lambda p: not p[1])
        total = 8 * len(PAYLOAD)
        for _ in range(8):
            transport.write(PAYLOAD)
        acked, _ = await _progress_until(sock, lambda p: p[1] and p[0] > start)
        assert acked - start < total  # the client's small buffer took some, the rest waits
        got = 0
        while got < total:
            got += len(await asyncio.to_thread(client.recv, 1 << 20))
        assert await _progress_until(sock, lambda p: not p[1]) == (start + total, False)
        assert transport.get_write_buffer_size() == 0


async def test_a_client_that_takes_nothing_while_bytes_wait_is_cut() -> None:
    async with connected() as (transport, _client):
        stalled = asyncio.get_running_loop().create_future()
        watch = ClientWatch(transport, STALL_S, lambda: stalled.set_result(None))
        for _ in range(64):  # more than its receive buffer: the rest waits in the kernel
            transport.write(PAYLOAD)
        await asyncio.wait_for(stalled, GUARD_S)
        watch.stop()


async def test_a_client_that_keeps_taking_is_never_cut_however_slowly() -> None:
    async with connected() as (transport, client):
        stalled: list[None] = []
        watch = ClientWatch(transport, STALL_S, lambda: stalled.append(None))
        total = 64 * len(PAYLOAD)
        for _ in range(64):
            transport.write(PAYLOAD)
        got = 0
        while got < total:  # 4 KiB a time, through a thread: many samples of the watch
            got += len(await asyncio.to_thread(client.recv, 4096))
        watch.stop()
        assert not stalled
