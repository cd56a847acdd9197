"""A rendered prompt's token ids as the gateway holds them: 4 bytes a token, with their JSON text.

An agent's 140K-token prompt as a Python list is 140K int objects: ~2 ms to make from
an array, ~0.6 ms more to encode into the engine request, every turn, for ids the turn
cache already held. So the cache keeps each chat segment's ids twice, as `array('I')`
(what routing's block keys, the derender's look at the prompt's end and the counts
read) and as the items of a JSON array (`b"1,2,3"`, what the engine request carries),
and a prompt is joined from its segments with neither made per token: ~0.1 ms for
140K ids (`scripts/bench_render.py`). Each form costs about 4 bytes a token more or
less (ids below 152K: ~6 bytes of text), what the turn cache's budget counts.

`TokenIds` is an `array('I')` (a `Sequence[int]` for every reader), so code that only
reads ids takes either form; what encodes them asks for `json_ids`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import msgspec

if TYPE_CHECKING:
    _IdArray = array[int]
else:
    _IdArray = array

_encode = msgspec.json.Encoder().encode


class TokenIds(_IdArray):
    """Token ids (`array('I')`) and `items`, the same ids as JSON array items (`b"1,2,3"`)."""

    __slots__ = ("items",)
    items: bytes

    def __new__(cls, ids: Iterable[int] = (), items: bytes | None = None) -> TokenIds:
        """`items`: the ids' JSON items when the caller has them (else encoded here)."""
        self = cast(TokenIds, super().__new__(cls, "I", ids))
        self.items = _encode(self.tolist())[1:-1] if items is None else items
        return self

    @classmethod
    def encoded(cls, ids: list[int]) -> TokenIds:
        """A fresh tokenization's ids (a list, as `tokenizers` gives them)."""
        return cls(ids, _encode(ids)[1:-1])

    @classmethod
    def joined(cls, parts: Iterable[TokenIds]) -> TokenIds:
        """The parts one after another: their arrays and their texts concatenated, no int made."""
        parts = [part for part in parts if part]  # an empty one would leave ",," in the text
        joined = cls((), b",".join(part.items for part in parts))
        for part in parts:
            joined += part
        return joined

    @property
    def nbytes(self) -> int:
        """What the two forms hold (the ids and their text), for a cache's budget."""
        return self.itemsize * len(self) + len(self.items)


def json_ids(ids: Sequence[int]) -> msgspec.Raw | list[int]:
    """`ids` as a msgspec-encodable value: a `TokenIds`' text as it is, anything else as a list."""
    if isinstance(ids, TokenIds):
        return msgspec.Raw(b"[" + ids.items + b"]")
    return ids if isinstance(ids, list) else list(ids)
