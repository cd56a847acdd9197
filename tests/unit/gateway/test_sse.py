"""The SSE reader is sans-IO: any split of the bytes gives the same payloads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.relay.sse import SSEError, SSEReader

STREAM = (
    b'data: {"a": 1}\n\n'
    b": onehop-engine-cpu-us=12\n\n"
    b"event: ping\ndata: two\ndata: lines\n\n"
    b'data: {"b": "\xe4\xb8\x96"}\r\n\r\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [b'{"a": 1}', b"two\nlines", b'{"b": "\xe4\xb8\x96"}', b"[DONE]"]


def read(pieces: list[bytes]) -> list[bytes]:
    reader = SSEReader()
    out: list[bytes] = []
    for piece in pieces:
        out += reader.feed(piece)
    return out + reader.flush()


def test_split_at_every_byte() -> None:
    for cut in range(len(STREAM) + 1):
        assert read([STREAM[:cut], STREAM[cut:]]) == EXPECTED
    assert read([bytes([b]) for b in STREAM]) == EXPECTED


@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_random_splits(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert read(pieces) == EXPECTED


def test_last_event_without_blank_line() -> None:
    assert read([b"data: x\n\ndata: tail"]) == [b"x", b"tail"]


CRLF = STREAM.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


def test_crlf_framing_at_every_split() -> None:
    for cut in range(len(CRLF) + 1):
        assert read([CRLF[:cut], CRLF[cut:]]) == EXPECTED
    assert read([bytes([b]) for b in CRLF]) == EXPECTED


def test_a_long_event_in_many_pieces_is_joined_once() -> None:
    """No re-scan of what is buffered: each piece is looked at once until the event ends."""
    reader = SSEReader()
    piece = b"x" * 1000
    assert reader.feed(b"data: ") == []
    for _ in range(500):
        assert reader.feed(piece) == []
    assert len(reader._parts) == 501  # kept as they came, never joined yet
    assert reader.feed(b"\n\n") == [piece * 500]
    assert reader._parts == []


def test_an_endless_event_is_refused() -> None:
    reader = SSEReader(max_event_bytes=10_000)
    with pytest.raises(SSEError, match="over 10000 bytes"):
        for _ in range(100):
            reader.feed(b"data: " + b"y" * 500)


@pytest.mark.parametrize(
    "garbage",
    [b"<html><body>502 Bad Gateway</body></html>\n\n", b"Traceback (most recent call last):\n  File x\n\n", b"{\"choices\": []}\n\n"],
)
def test_bytes_that_are_not_sse_are_refused(garbage: bytes) -> None:
    with pytest.raises(SSEError, match="not a server-sent event"):
        read([b"data: ok\n\n", garbage])
