"""Server-sent events: an incremental, sans-IO reader and the writer's framing."""

from __future__ import annotations

DONE = b"[DONE]"


class SSEReader:
    """Feed bytes as they arrive; get the `data:` payloads of complete events.

    Comment lines (`: ...`) and other fields are skipped; a multi-line `data`
    event is joined with newlines, as the SSE spec says.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data if self._buffer else data
        if b"\n\n" not in buffer:
            self._buffer = buffer
            return []
        *events, self._buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        payloads: list[bytes] = []
        for event in events:
            payload = _data_of(event)
            if payload is not None:
                payloads.append(payload)
        return payloads

    def flush(self) -> list[bytes]:
        """A last event the stream ended without a blank line after."""
        rest, self._buffer = self._buffer, b""
        payload = _data_of(rest.rstrip(b"\n")) if rest.strip() else None
        return [] if payload is None else [payload]


def _data_of(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common one-line event, without a copy of the line list
    parts = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


DONE_FRAME = frame(DONE)
