"""Top-level request fields this gateway does not know, on the APIs agents speak.

Codex CLI and Claude Code add request fields every few releases (`client_metadata`,
`context_management`, ...). On `/v1/responses` and `/v1/messages` an unknown top-level field
is ignored by default, as vLLM's own servers ignore one, and `agents.unknown_fields: refuse`
makes it a 400 naming the field. Each ignored name is counted in
`onehop_gateway_ignored_fields` and logged once.

The strict decoder runs first, so a request with no unknown field costs nothing more; only
one that has some is decoded again, leniently, and has its top-level keys read.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

log = logging.getLogger(__name__)

T = TypeVar("T")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
"""msgspec's words for an unknown field at the top level (a nested one ends with ` - at `$...``)."""
MAX_NAMES = 64
"""Distinct ignored names counted under their own label (and logged); later ones count as `_other`,
so a client cannot grow the metric without bound."""
MAX_NAME_CHARS = 64
OTHER = "_other"


@dataclass(frozen=True, slots=True)
class Decoded(Generic[T]):
    request: T
    ignored: tuple[str, ...] = ()
    """Unknown top-level fields left out, in the body's order."""


class TolerantDecoder(Generic[T]):
    """A strict struct decoder that can leave unknown top-level fields out.

    `strict` must forbid unknown fields; `lenient` is the same struct without that (a subclass
    with `forbid_unknown_fields=False`), so what it returns is still a `strict` instance."""

    def __init__(self, strict: type[T], lenient: type[T]) -> None:
        self._strict = msgspec.json.Decoder(strict)
        self._lenient = msgspec.json.Decoder(lenient)
        self._known = frozenset(f.encode_name for f in msgspec.structs.fields(strict))  # type: ignore[arg-type]

    def decode(self, body: bytes, *, ignore_unknown: bool) -> Decoded[T]:
        """Raises msgspec's errors as they are (the caller words them); an unknown top-level
        field is one of them unless `ignore_unknown`."""
        try:
            return Decoded(self._strict.decode(body))
        except msgspec.ValidationError as exc:
            if not ignore_unknown or _UNKNOWN.fullmatch(str(exc)) is None:
                raise
        request = self._lenient.decode(body)  # any other error is raised here, with its path
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        return Decoded(request, tuple(key for key in keys if key not in self._known))


@dataclass
class IgnoredFields:
    """The names ignored so far in this process: counted, each logged the first time."""

    names: set[str] = field(default_factory=set)
    """Names with a label of their own (at most MAX_NAMES)."""
    logged: set[tuple[str, str]] = field(default_factory=set)

    def record(self, endpoint: str, names: tuple[str, ...], counter: Any) -> None:
        """`counter`: the labelled Prometheus counter (endpoint, field)."""
        for name in names:
            label = self._label(name)
            counter.labels(endpoint, label).inc()
            if label != OTHER and (endpoint, label) not in self.logged:
                self.logged.add((endpoint, label))
                log.info(
                    "ignored the unknown request field %r on /v1/%s (agents.unknown_fields: ignore)", label, endpoint
                )

    def _label(self, name: str) -> str:
        if len(name) > MAX_NAME_CHARS or not name.isprintable():
            return OTHER
        if name in self.names or len(self.names) < MAX_NAMES:
            self.names.add(name)
            return name
        return OTHER
