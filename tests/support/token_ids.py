"""A render's ids as a list, once their two forms are checked to agree."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gateway.render.token_ids import TokenIds


def id_list(rendered: Sequence[int]) -> list[int]:
    """`rendered` as a list; a `TokenIds`' JSON text (what an engine request carries) must
    hold exactly its ids."""
    ids = list(rendered)
    if isinstance(rendered, TokenIds):
        assert msgspec.json.decode(b"[" + rendered.items + b"]") == ids, "the ids' JSON text differs from the ids"
    return ids
