"""Per-token decode tables built once per tokenizer.

The hot path never calls into the tokenizer: a byte-level BPE token decodes to
a fixed byte string, so one table lookup per token replaces a `decode()` call.
Added tokens (specials, and markers such as `<think>`) are kept apart because
the tokenizer renders them atomically from their content, never byte by byte.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders

from engine.derender.errors import TokenIdOutOfRange


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
    return {chr(cp): byte for byte, cp in zip(printable, codepoints)}


def _byte_level_bytes(token: str) -> bytes:
    table = _unicode_to_byte()
    return bytes(table[ch] for ch in token)


class TokenVocab:
    """What derender needs to know about a tokenizer, precomputed.

    `token_bytes[i]` is the byte string of token `i` for byte-level vocabularies
    (empty for non-byte-level ones); `added_text` maps every added token to its
    content; `special_ids` are the ones `skip_special_tokens` removes.
    """

    __slots__ = ("backend", "byte_level", "token_bytes", "added_text", "special_ids", "size", "parsers", "_pieces")

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

    def __repr__(self) -> str:
        kind = "byte-level" if self.byte_level else "windowed"
        return f"TokenVocab({self.size} tokens, {kind}, {len(self.added_text)} added)"

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
            table[tid] = _byte_level_bytes(token)
    return TokenVocab(
        backend=backend,
        byte_level=byte_level,
        token_bytes=tuple(table),
        added_text=added,
        special_ids=special,
        size=size,
    )


_VOCABS: dict[int, TokenVocab] = {}


def vocab_for(tokenizer: Any) -> TokenVocab:
    """The `TokenVocab` of a HF tokenizer or `tokenizers.Tokenizer`, built once per object."""
    backend = _backend_of(tokenizer)
    key = id(backend)
    vocab = _VOCABS.get(key)
    if vocab is None or vocab.backend is not backend:
        vocab = _build(backend)
        _VOCABS[key] = vocab
    return vocab
