"""Per-token decode tables built once per tokenizer.

The hot path never calls into the tokenizer: a byte-level BPE token decodes to
a fixed byte string, so one table lookup per token replaces a `decode()` call.
Added tokens (specials, and markers such as `<think>`) are kept apart because
the tokenizer renders them atomically from their content, never byte by byte.

Not every entry of a byte-level vocabulary is written in the byte-level
alphabet: DeepSeek-V3's `tokenizer.json` keeps `<｜begin▁of▁sentence｜>` and
its kin as raw strings in `model.vocab` (issue #27). Such an entry's bytes are
taken from the tokenizer's own decode of its id.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders

from derender.errors import TokenIdOutOfRange


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (bytes 0..255 as printable code points)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codepoints.append(256 + extra)
            extra += 1
    return {chr(cp): byte for byte, cp in zip(printable, codepoints, strict=True)}


def _byte_level_bytes(backend: Tokenizer, token: str, token_id: int) -> bytes:
    """The bytes a byte-level vocabulary entry stands for; an entry written outside the
    byte-level alphabet (a raw marker string) is what the tokenizer decodes it to."""
    table = _unicode_to_byte()
    try:
        return bytes([table[ch] for ch in token])
    except KeyError:
        return backend.decode([token_id], skip_special_tokens=False).encode()


class TokenVocab:
    """What derender needs to know about a tokenizer, precomputed.

    `token_bytes[i]` is the byte string of token `i` for byte-level vocabularies
    (empty for non-byte-level ones); `added_text` maps every added token to its
    content; `special_ids` are the ones `skip_special_tokens` removes.
    """

    __slots__ = (
        "_complete",
        "_pieces",
        "added_text",
        "backend",
        "byte_level",
        "parsers",
        "size",
        "special_ids",
        "token_bytes",
    )

    def __init__(
        self,
        *,
        backend: Tokenizer,
        byte_level: bool,
        token_bytes: tuple[bytes, ...],
        added_text: dict[int, str],
        special_ids: frozenset[int],
        size: int,
    ) -> None:
        self.backend = backend
        self.byte_level = byte_level
        self.token_bytes = token_bytes
        self.added_text = added_text
        self.special_ids = special_ids
        self.size = size
        self.parsers: dict[tuple[str | None, str | None], object] = {}
        """Parser families bound to this vocabulary, by (reasoning, tool) name (`bind_parsers`)."""
        self._pieces: dict[int, tuple[str, list[int]]] = {}
        self._complete: tuple[str | None, ...] | None = None

    def __repr__(self) -> str:
        kind = "byte-level" if self.byte_level else "windowed"
        return f"TokenVocab({self.size} tokens, {kind}, {len(self.added_text)} added)"

    def complete_text(self) -> tuple[str | None, ...]:
        """Each ordinary token's text when its bytes are valid UTF-8 alone, else None;
        added tokens are None too, so the detokenizer's hot path needs a single test.
        Built on first use and kept with the vocabulary (dies with it)."""
        table = self._complete
        if table is None:
            out: list[str | None] = []
            for raw in self.token_bytes:
                try:
                    out.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append(None)
            for token_id in self.added_text:
                out[token_id] = None
            table = self._complete = tuple(out)
        return table

    def check_ids(self, token_ids: Sequence[int]) -> None:
        """Raise `TokenIdOutOfRange` for an id the tokenizer cannot decode."""
        size = self.size
        for token_id in token_ids:
            if token_id < 0 or token_id >= size:
                raise TokenIdOutOfRange(token_id, size)

    def token_id(self, text: str) -> int | None:
        """The id of a single-token string such as a marker, else None."""
        return self.backend.token_to_id(text)

    def piece_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to the output (for logprobs)."""
        text = self.added_text.get(token_id)
        if text is not None:
            return text.encode()
        if self.byte_level:
            return self.token_bytes[token_id]
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """(decoded string, byte list) of one token, as OpenAI logprobs show it.

        A token holding part of a UTF-8 character decodes to U+FFFD in `token`;
        `bytes` carries the real bytes so clients can rebuild the text.
        """
        cache = self._pieces
        hit = cache.get(token_id)
        if hit is None:
            # A top-logprob candidate may be an id the tokenizer has no entry
            # for (Qwen3 pads its embeddings past the vocabulary): it shows as
            # "" with no bytes, as a tokenizer decodes it. Sampled ids are
            # refused earlier, by `check_ids`.
            raw = self.piece_bytes(token_id) if 0 <= token_id < self.size else b""
            hit = (raw.decode("utf-8", "replace"), list(raw))
            cache[token_id] = hit
        return hit


def _backend_of(tokenizer: Any) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"derender needs a `tokenizers`-backed tokenizer, got {type(tokenizer).__name__}")
    return backend


def _is_byte_level(backend: Tokenizer) -> bool:
    return isinstance(backend.decoder, decoders.ByteLevel)


def _build(backend: Tokenizer) -> TokenVocab:
    added = {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()}
    special = frozenset(tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special)
    size = backend.get_vocab_size(with_added_tokens=True)
    size = max([size, *(tid + 1 for tid in added)])
    byte_level = _is_byte_level(backend)
    table: list[bytes] = [b""] * size
    if byte_level:
        for token, tid in backend.get_vocab(with_added_tokens=False).items():
            table[tid] = _byte_level_bytes(backend, token, tid)
    return TokenVocab(
        backend=backend,
        byte_level=byte_level,
        token_bytes=tuple(table),
        added_text=added,
        special_ids=special,
        size=size,
    )


VOCAB_CACHE_SIZE = 4
"""Vocabularies `vocab_for` keeps for tokenizers it was asked about. Whoever serves a model
holds its vocabulary itself (the gateway's model runtime, the engine state); this only
spares rebuilding one for a tokenizer asked about again, and never keeps more."""


class _RecentVocabs:
    """The last few vocabularies built, by tokenizer identity. Each holds its tokenizer,
    so an id here never names a newer object; an evicted one is rebuilt on its next use."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._vocabs: OrderedDict[int, TokenVocab] = OrderedDict()
        self._lock = threading.Lock()  # the gateway and engine build off the loop, in threads

    def get(self, backend: Tokenizer) -> TokenVocab:
        key = id(backend)
        with self._lock:
            vocab = self._vocabs.get(key)
            if vocab is not None and vocab.backend is backend:
                self._vocabs.move_to_end(key)
                return vocab
        vocab = _build(backend)
        with self._lock:
            self._vocabs[key] = vocab
            self._vocabs.move_to_end(key)
            while len(self._vocabs) > self._size:
                self._vocabs.popitem(last=False)
        return vocab


_RECENT = _RecentVocabs(VOCAB_CACHE_SIZE)


def vocab_for(tokenizer: Any) -> TokenVocab:
    """The `TokenVocab` of a HF tokenizer or `tokenizers.Tokenizer` (the same object for the
    same tokenizer while it is among the last `VOCAB_CACHE_SIZE` asked about)."""
    return _RECENT.get(_backend_of(tokenizer))
