"""The SSE reader is sans-IO: any split of the bytes gives the same payloads."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.sse import SSEReader

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
