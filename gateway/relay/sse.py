"""Server-sent events: an incremental, sans-IO reader and the writer's framing."""

from __future__ import annotations

DONE = b"[DONE]"


MAX_EVENT_BYTES = 64 * 1024 * 1024
"""An event longer than this is not one: the stream is refused rather than buffered."""
_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")


class SSEError(ValueError):
    """Bytes that are not a server-sent event stream (an HTML page, a stack trace, an endless event)."""


class SSEReader:
    """Feed bytes as they arrive; get the `data:` payloads of complete events.

    Comment lines (`: ...`) and the other SSE fields are skipped; a multi-line
    `data` event is joined with newlines, as the SSE spec says. Lines may end
    in LF or CRLF. Each byte is looked at a bounded number of times however
    the stream is cut (an event arriving in many pieces is joined once, when
    it is whole), and an event longer than `max_event_bytes`, or a line that
    is no SSE field, raises `SSEError`.
    """

    __slots__ = ("_cr", "_limit", "_parts", "_size")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._cr = False
        self._limit = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        if (
            not self._parts
            and not self._cr
            and data.startswith(b"data: ")
            and data.find(b"\n") == len(data) - 2
            and data.endswith(b"\n\n")
        ):
            return [data[6:-2]]  # the usual read: one whole one-line event
        if self._cr:  # a CR held back from the previous piece, in case an LF follows
            data, self._cr = b"\r" + data, False
        if data.endswith(b"\r"):
            data, self._cr = data[:-1], True
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        parts = self._parts
        ends_event = b"\n\n" in data or (bool(parts) and parts[-1].endswith(b"\n") and data.startswith(b"\n"))
        if not ends_event:
            if data:
                parts.append(data)
                self._size += len(data)
                if self._size > self._limit:
                    raise SSEError(f"an event over {self._limit} bytes")
            return []
        buffer = b"".join((*parts, data)) if parts else data
        *events, rest = buffer.split(b"\n\n")
        self._parts = [rest] if rest else []
        self._size = len(rest)
        payloads: list[bytes] = []
        for event in events:
            payload = _data_of(event)
            if payload is not None:
                payloads.append(payload)
        return payloads

    def flush(self) -> list[bytes]:
        """A last event the stream ended without a blank line after."""
        rest = b"".join(self._parts)
        self._parts, self._size, self._cr = [], 0, False
        payload = _data_of(rest.rstrip(b"\n")) if rest.strip() else None
        return [] if payload is None else [payload]


def _data_of(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common one-line event, without a copy of the line list
    lines = event.split(b"\n")
    for line in lines:
        if line and not line.startswith(_FIELDS):
            raise SSEError(f"not a server-sent event: {event[:120]!r}")
    parts = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


DONE_FRAME = frame(DONE)
