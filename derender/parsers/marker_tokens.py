"""Plumbing shared by the families whose every marker is a special token (kimi_k2, mistral).

With the default `skip_special_tokens` a marker's piece arrives as `("", id)`,
so these families read markers from an id table, `Kinds`: token id →
(kind, marker text). A piece is a marker when its id is in the table and its
text is the marker's text or empty (`split_marker`); other special tokens are
`DROP` (vLLM shows none of them). Each family numbers its own kinds from
`FIRST_KIND`.

`MarkerToolParser` is the common half of their tool parsers: the per-token
dispatch, the call header and the arguments JSON (`ArgumentsText`); the
family gives the grammar (`_text`, `_marker`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

from derender.parsers.base import ParseOptions, ToolDelta, ToolParser
from derender.parsers.content import ContentText
from derender.parsers.json_arguments import ArgumentsText
from derender.stop import Piece
from derender.vocab import TokenVocab

DROP, TEXT = 0, 1
"""Kinds every table has: dropped wherever it appears; text to the parser reading it."""
FIRST_KIND = 2
CONTENT = 0
"""The first state of every family's tool parser; each numbers its others from 1."""

Kinds = Mapping[int, tuple[int, str]]


def optional_id(vocab: TokenVocab, text: str) -> int:
    """The marker's id, or -1 when this tokenizer lacks it."""
    found = vocab.token_id(text)
    return -1 if found is None else found


def add_specials(vocab: TokenVocab, kinds: dict[int, tuple[int, str]]) -> None:
    """Other special tokens are dropped wherever they appear (vLLM's parsers drop them)."""
    for token_id in vocab.special_ids:
        if token_id not in kinds:
            kinds[token_id] = (DROP, vocab.added_text.get(token_id, ""))


def with_kinds(
    kinds: Kinds, cache: dict[tuple[tuple[int, str], ...], Kinds], extra: Mapping[int, str], kind: int
) -> Kinds:
    """`kinds` with the other family's markers (`extra`, id → text) as `kind`, built once per set."""
    if not extra:
        return kinds
    key = tuple(sorted(extra.items()))
    found = cache.get(key)
    if found is None:
        merged = dict(kinds)
        merged.update((token_id, (kind, text)) for token_id, text in extra.items())
        found = cache[key] = merged
    return found


def split_marker(text: str, marker: str) -> str | None:
    """The text before a marker piece's marker, or None when the piece is only text."""
    if text.endswith(marker):
        return text[: len(text) - len(marker)]
    return "" if not text else None


def add_held(text: str, reasoning: list[str], space: list[str]) -> None:
    """Reasoning text with its trailing whitespace held in `space` until more text follows
    (vLLM strips reasoning, so a run that nothing follows is dropped)."""
    body = text.rstrip()
    if not body:
        space.append(text)
        return
    if space:
        reasoning.extend(space)
        space.clear()
    reasoning.append(body)
    if len(body) < len(text):
        space.append(text[len(body) :])


class MarkerToolParser(ToolParser):
    """One choice's tool parsing over a `Kinds` table; subclasses give the grammar."""

    __slots__ = ("_args", "_content", "_deltas", "_index", "_kinds", "_options", "_space", "_state", "calls")

    def __init__(self, kinds: Kinds, options: ParseOptions) -> None:
        self._kinds = kinds
        self._options = options
        self._content = ContentText()
        self._deltas: list[ToolDelta] = []
        self._state = CONTENT
        self._args: ArgumentsText | None = None
        self._index = -1  # the open call's index, -1 when it is not streamed
        self._space: list[str] = []  # whitespace held before a call, dropped once one is made
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        kinds = self._kinds
        for text, token_id in pieces:  # hot loop: one iteration per content token
            kind = kinds.get(token_id)
            head = None if kind is None else split_marker(text, kind[1])
            if kind is None or head is None:
                if text:
                    self._text(text)
                continue
            if head:
                self._text(head)
            if kind[0] != DROP:
                self._marker(kind[0], kind[1])

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    def _open_args(self, name: str) -> bool:
        """A call's header: its arguments JSON opens, typed by the tool's schema. True when
        the call streams (the family sends the header: only then may it take an id)."""
        schema = self._options.schema_of(name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        self._args = ArgumentsText(properties if isinstance(properties, Mapping) else None)
        if self.calls and not self._options.parallel_tool_calls:
            self._index = -1  # parallel_tool_calls=false keeps the first call only
            return False
        self._index = self.calls
        self.calls += 1
        return True

    def _finish_args(self) -> None:
        """The call ends: its arguments JSON is closed and sent."""
        args = self._args
        assert args is not None
        args.finish()
        self._emit_args()
        self._args = None

    def _emit_args(self) -> None:
        assert self._args is not None
        out = self._args.take()
        if out and self._index >= 0:
            self._deltas.append(ToolDelta(index=self._index, arguments=out))

    @abstractmethod
    def _text(self, text: str) -> None:
        """Text (not a marker) in the current state."""

    @abstractmethod
    def _marker(self, kind: int, text: str) -> None:
        """A marker of `kind` (never `DROP`); `text` is its marker text."""
