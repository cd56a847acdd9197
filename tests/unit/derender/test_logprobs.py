"""Logprob formatting: candidates the tokenizer cannot decode (padded vocabulary rows)."""

from __future__ import annotations

import pytest

from derender.errors import TokenIdOutOfRange
from derender.logprobs import chat_logprobs, completion_logprobs
from derender.vocab import TokenVocab
from wire.protocol import GenerateLogProb, GenerateLogProbsContent


def entry(vocab: TokenVocab, sampled: int, padded: int) -> GenerateLogProbsContent:
    return GenerateLogProbsContent(
        token_id=sampled,
        logprob=-0.5,
        rank=1,
        top_logprobs=[
            GenerateLogProb(token_id=sampled, logprob=-0.5, rank=1),
            GenerateLogProb(token_id=padded, logprob=-1.5, rank=2),
        ],
    )


def test_a_candidate_past_the_vocabulary_shows_as_an_empty_token(qwen3_vocab: TokenVocab) -> None:
    sampled = qwen3_vocab.backend.token_to_id("Hello")
    assert sampled is not None
    padded = qwen3_vocab.size + 137  # an embedding row past the tokenizer (Qwen3 pads to 151,936)
    (token,) = chat_logprobs(qwen3_vocab, [entry(qwen3_vocab, sampled, padded)], top_n=2)
    assert token.token == "Hello" and token.bytes == list(b"Hello")
    assert [(t.token, t.bytes, t.logprob) for t in token.top_logprobs] == [
        ("Hello", list(b"Hello"), -0.5),
        ("", [], -1.5),
    ]
    legacy = completion_logprobs(qwen3_vocab, [entry(qwen3_vocab, sampled, padded)], top_n=2, text_offset=0)
    assert legacy.tokens == ["Hello"] and legacy.top_logprobs == [{"Hello": -0.5, "": -1.5}]


def test_a_sampled_id_past_the_vocabulary_is_still_refused(qwen3_vocab: TokenVocab) -> None:
    with pytest.raises(TokenIdOutOfRange):
        qwen3_vocab.check_ids([qwen3_vocab.size + 137])
