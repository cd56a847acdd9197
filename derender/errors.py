"""Errors raised by derender.

    DerenderError            base class; the engine and gateway map it to a 400
    └── TokenIdOutOfRange    a token id the tokenizer has no entry for

    AnswerNotKept            a streamed derender was asked for the whole answer
                             it did not keep (a bug of the caller: a 500)
"""

from __future__ import annotations


class DerenderError(ValueError):
    """Input that derender cannot turn into text."""


class TokenIdOutOfRange(DerenderError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"token id {token_id} is out of range for a vocabulary of {vocab_size} tokens")
        self.token_id = token_id
        self.vocab_size = vocab_size


class AnswerNotKept(RuntimeError):
    """A derender made with `keep_answer=False` was asked for its non-streaming answer."""
