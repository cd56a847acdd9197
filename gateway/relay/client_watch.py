"""Whether a streaming client takes what it is sent, measured at its socket.

A client that stops reading is not seen by the transport until the kernel's
send buffer is full (up to 4 MiB with autotuning): a write "waits" only then,
so a timed write cut such a client 60-90 s after it stopped, and eight of them
held every admission slot for 100 s and more (issue #27). The watch instead
samples the socket twice a `client_write_s`: the bytes the client's side has
acknowledged (`tcpi_bytes_acked`, Linux's TCP_INFO) and whether any wait for it
(unacknowledged or unsent in the kernel, or in the transport's buffer). A
client that took nothing while bytes waited for it for `client_write_s` is cut:
its transport aborted, which cancels its handler (`handler_cancellation`), so
its engine requests are aborted and it counts as a 499, as for a client that
left. Where TCP_INFO cannot be read (another OS, a Unix socket) only the
transport's own buffer is seen.

Nothing here runs per chunk: one timer per stream, and one `getsockopt` per
sample.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_BYTES = 148
"""Linux's `struct tcp_info` up to `tcpi_notsent_bytes` (Linux 4.6 and later)."""
_UNACKED = struct.Struct("=I")
_UNACKED_AT = 24
"""`tcpi_unacked`: segments sent and not yet acknowledged."""
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
"""`tcpi_bytes_acked`: every byte the peer has acknowledged (its side took them)."""
_NOTSENT = struct.Struct("=I")
_NOTSENT_AT = 144
"""`tcpi_notsent_bytes`: bytes in the send queue not sent yet (a full peer window holds them)."""

Progress = tuple[int, bool]
"""(a count that moves whenever the client takes bytes, whether bytes wait for it)."""


def tcp_progress(sock: socket.socket) -> Progress | None:
    """The client's progress from its TCP socket's kernel state; None where it cannot be read."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES:
        return None
    acked = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]
    waiting = bool(_UNACKED.unpack_from(info, _UNACKED_AT)[0] or _NOTSENT.unpack_from(info, _NOTSENT_AT)[0])
    return acked, waiting


class ClientWatch:
    """Samples one client's progress every `stall_s / 2` and calls `on_stall` once, when the
    client took nothing for `stall_s` while bytes waited for it; `stop` at the stream's end."""

    __slots__ = ("_handle", "_last", "_loop", "_on_stall", "_progress_at", "_sock", "_stall_s", "_transport")

    def __init__(self, transport: asyncio.Transport, stall_s: float, on_stall: Callable[[], None]) -> None:
        self._transport = transport
        self._stall_s = stall_s
        self._on_stall = on_stall
        self._loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        self._sock: socket.socket | None = sock if tcp else None
        self._last: Progress = (-1, False)
        """The last sample: none yet (the first one counts as progress, so a stream's start costs no syscall)."""
        self._progress_at = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._progress_at + stall_s / 2, self._check)

    def _sample(self) -> Progress:
        buffered = self._transport.get_write_buffer_size()
        if self._sock is not None:
            kernel = tcp_progress(self._sock)
            if kernel is not None:
                return kernel[0], kernel[1] or buffered > 0
            self._sock = None  # not readable here: the transport's buffer alone from now on
        # The transport's buffer only: it changes as the client takes bytes (or as more are
        # written, until the transport pauses and the writers wait for it).
        return buffered, buffered > 0

    def _check(self) -> None:
        now = self._loop.time()
        if self._transport.is_closing():
            self._handle = None
            return
        sample = self._sample()
        taken, waiting = sample
        # The clock runs only while bytes wait for the client at two samples in a row and it
        # takes none of them: one that is idle because the engine is slow is never cut.
        if taken != self._last[0] or not waiting or not self._last[1]:
            self._progress_at = now
        elif now - self._progress_at >= self._stall_s:
            self._handle = None
            self._on_stall()
            return
        self._last = sample
        self._handle = self._loop.call_at(now + self._stall_s / 2, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
