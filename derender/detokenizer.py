"""Incremental detokenizers: one token id in, the text it completes out.

Per token the work is constant (hot path): the byte-level detokenizer looks the
token up in a precomputed table and only falls back to an incremental UTF-8
decoder while a multi-byte character is split across tokens. Nothing is ever
re-decoded, so a 4k-token output costs the same per token as a 16-token one.

Flush policy (DERENDER_CASES 1, issue #27): while a multi-byte character is
split across tokens, the text of the tokens since the one that began it is held
back (its leading space too). An added token that is not skipped ends the
character as U+FFFD, as a one-shot `tokenizer.decode(ids)` does; an output that
ends inside the character (`max_tokens` cut it) drops it at `finish()`, held
text with it, as vLLM's incremental detokenizer does. So no U+FFFD, and no
stray space, ever ends an answer.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from derender.vocab import TokenVocab

_REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """Text completed by this token (may be empty while bytes are held)."""

    def finish(self) -> str:
        """Text still held at the end of the output."""


class ByteLevelDetokenizer:
    """Byte-level BPE (GPT-2 style, Qwen, Llama 3): tokens are byte strings.

    Added tokens decode atomically from their content; a partial character
    before one can never complete, so it is flushed as U+FFFD first — the same
    as a full decode. A skipped special token is invisible and flushes nothing,
    as it is removed before decoding there too. Text decoded while a character
    is incomplete waits in `_held` (the slow path only: the hot path is one
    table lookup while nothing is pending).
    """

    __slots__ = ("_added", "_bytes", "_held", "_pending", "_skipped", "_text", "_utf8")

    def __init__(self, vocab: TokenVocab, *, skip_special_tokens: bool = True) -> None:
        self._bytes = vocab.token_bytes
        self._text = vocab.complete_text()
        self._added = vocab.added_text
        self._skipped = vocab.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = False
        self._held = ""

    def step(self, token_id: int) -> str:
        if not self._pending:
            text = self._text[token_id]
            if text is not None:
                return text
        added = self._added.get(token_id)
        if added is not None:
            if token_id in self._skipped:
                return ""
            return self._flush() + added
        text = self._utf8.decode(self._bytes[token_id])
        if self._utf8.getstate()[0]:  # a character is still incomplete: hold its token's text
            self._pending = True
            self._held += text
            return ""
        self._pending = False
        if self._held:
            text = self._held + text
            self._held = ""
        return text

    def _flush(self) -> str:
        """Held text and the incomplete character as U+FFFD (what a full decode shows)."""
        if not self._pending:
            return ""
        self._pending = False
        text = self._held + self._utf8.decode(b"", True)
        self._held = ""
        return text

    def finish(self) -> str:
        """The output ended inside a character: drop it and the text held with it."""
        if self._pending:
            self._pending = False
            self._held = ""
            self._utf8.reset()
        return ""


class WindowDetokenizer:
    """Any other `tokenizers` decoder (SentencePiece, WordPiece...).

    Decodes a short sliding window of ids and emits the part past the text
    already emitted; the window keeps a few earlier tokens so context-dependent
    decoders (leading-space rules) see the same neighbours a full decode does.
    The window is bounded, so each step costs O(1).
    """

    _CONTEXT = 5

    def __init__(
        self,
        vocab: TokenVocab,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = vocab.backend
        self._skip = skip_special_tokens
        del spaces_between_special_tokens  # `tokenizers` decoders never insert them
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""
        # A decoder that is not prefix-stable (DERENDER_CASES 2) can rewrite the
        # tail of `prefix_text`; emit only past what was already emitted.
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > self._CONTEXT:
            drop = self._prefix - self._CONTEXT
            del self._ids[:drop]
            self._prefix -= drop
            self._read -= drop
        return delta

    def finish(self) -> str:
        """Text still held; none when it ends inside a character (dropped, as in `step`)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        self._prefix = self._read
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""
        return new_text[len(prefix_text) :]


def make_detokenizer(
    vocab: TokenVocab,
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    prompt_token_ids: Sequence[int] = (),
) -> Detokenizer:
    """The fastest correct detokenizer for this vocabulary.

    `spaces_between_special_tokens` only matters for decoders that join tokens
    with spaces; byte-level decoding concatenates, as vLLM's fast path does.
    """
    if vocab.byte_level:
        return ByteLevelDetokenizer(vocab, skip_special_tokens=skip_special_tokens)
    return WindowDetokenizer(
        vocab,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        prompt_token_ids=prompt_token_ids,
    )
