"""The simulator's prose: word pieces encoded once, so text is built from ids per request.

Plain ASCII words, and a few multi-byte ones (``世界``, ``🫠``, ``𓀀``, ``café``) that
byte-level tokens split, so detokenizers meet split characters.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer

from engine.backends.sim.tokenizer import encoder

_SENTENCE_WORDS = (5, 12)

_ASCII_WORDS = (
    "the", "a", "of", "to", "and", "in", "request", "token", "stream", "latency", "queue", "batch", "prefill",
    "decode", "cache", "model", "server", "client", "load", "test", "engine", "router", "shard", "replica", "budget",
    "window", "chunk", "step", "signal", "metric", "trace", "span", "sample", "output", "prompt", "context", "reply",
    "answer", "result", "value", "simple", "steady", "quick", "quiet", "bright", "plain", "river", "mountain",
    "harbor", "garden", "lantern", "copper", "marble", "amber", "violet", "meadow", "orbit", "pixel", "vector",
    "kernel", "packet", "socket", "buffer",
)
# Multi-byte words: split across byte-level tokens, they exercise UTF-8 reassembly.
_EXOTIC_WORDS = ("世界", "🫠", "𓀀", "café", "naïve", "Ωmega")
ALL_WORDS = (*_ASCII_WORDS, *_EXOTIC_WORDS)


class Words:
    """Word pieces encoded once, so prose is built from ids without encoding per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        enc = encoder(tokenizer)
        self.lower = [enc(" " + w) for w in ALL_WORDS]
        self.capital = [enc(" " + w.capitalize()) for w in ALL_WORDS]
        self.first = [enc(w.capitalize()) for w in ALL_WORDS]
        self.ascii = self.lower[: len(_ASCII_WORDS)]
        self.period = enc(".")
        # One-token words top up an exact token count without splitting a word.
        self.singles = [piece for piece in self.ascii if len(piece) == 1]

    def sentences(self, rng: random.Random, words: int, *, start: bool) -> list[list[int]]:
        """`words` words as sentences, one piece (list of ids) per word or period."""
        pieces: list[list[int]] = []
        left = words
        while left > 0:
            length = min(left, rng.randint(*_SENTENCE_WORDS))
            head = self.first if start and not pieces else self.capital
            pieces.append(head[rng.randrange(len(head))])
            pieces.extend(self.lower[rng.randrange(len(self.lower))] for _ in range(length - 1))
            pieces.append(self.period)
            left -= length
        return pieces

    def exactly(self, rng: random.Random, tokens: int) -> list[int]:
        """Prose of exactly `tokens` ids, ending on whole words."""
        out: list[int] = []
        for piece in self.sentences(rng, tokens, start=True):
            if len(out) + len(piece) > tokens:
                break
            out.extend(piece)
        while len(out) < tokens and self.singles:
            out.extend(self.singles[rng.randrange(len(self.singles))])
        return out[:tokens]

    def padding(self, rng: random.Random) -> Iterator[int]:
        """An endless stream of ASCII word ids (any cut is valid UTF-8)."""
        while True:
            yield from self.ascii[rng.randrange(len(self.ascii))]


def phrase(rng: random.Random) -> str:
    """One to three words, for string values."""
    return " ".join(rng.choice(ALL_WORDS) for _ in range(rng.randint(1, 3)))
