"""A streamed derender (`keep_answer=False`) sends what a kept one sends, and keeps no answer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.completion import CompletionDerender, CompletionOptions
from derender.errors import AnswerNotKept
from derender.vocab import TokenVocab
from engine.qwen3.vocab import IM_END_ID
from tests.support.streams import fake_logprobs

OUTPUT = (
    "<think>\nThe user wants the weather 🫠 in Paris.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _chat(vocab: TokenVocab, keep: bool) -> ChatDerender:
    options = ChatOptions(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True, logprobs=True, top_logprobs=2)
    ids = iter(range(100))
    return ChatDerender(
        vocab,
        options,
        model="m",
        n=2,
        response_id="chatcmpl-1",
        created=1,
        include_usage=True,
        new_tool_call_id=lambda: f"chatcmpl-tool-{next(ids)}",
        keep_answer=keep,
    )


def _feed(derender: Any, ids: list[int]) -> list[bytes]:
    logprobs = fake_logprobs(ids)
    chunks = []
    for index in range(len(derender.choices)):
        for i, token in enumerate(ids):
            finish = "stop" if i == len(ids) - 1 else None
            chunk = derender.step(index, [token], logprobs[i : i + 1], finish_reason=finish)
            if chunk is not None:
                chunks.append(msgspec.json.encode(chunk))
    return chunks


def test_a_streamed_chat_sends_the_same_chunks_and_usage(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = [*qwen3_tokenizer.encode(OUTPUT), IM_END_ID]
    kept, streamed = _chat(qwen3_vocab, True), _chat(qwen3_vocab, False)
    assert _feed(streamed, ids) == _feed(kept, ids)
    assert streamed.usage() == kept.usage()
    assert [c.finish_reason for c in streamed.choices] == ["tool_calls", "tool_calls"]
    assert msgspec.json.encode(streamed.usage_chunk()) == msgspec.json.encode(kept.usage_chunk())
    # Nothing of the answer stays: no ids, deltas, calls or logprobs per choice.
    for choice in streamed.choices:
        assert choice.token_ids == [] and choice.completion_tokens == len(ids)
        assert not (choice._reasoning or choice._content or choice._calls or choice._logprobs)
    with pytest.raises(AnswerNotKept):
        streamed.response()
    assert kept.response().choices[0].message.tool_calls is not None


def test_a_streamed_completion_sends_the_same_chunks(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    ids = qwen3_tokenizer.encode("Once upon a time 🫠 there was a parser.")

    def make(keep: bool) -> CompletionDerender:
        return CompletionDerender(qwen3_vocab, CompletionOptions(logprobs=2), model="m", response_id="cmpl-1", created=1, keep_answer=keep)

    kept, streamed = make(True), make(False)
    assert _feed(streamed, ids) == _feed(kept, ids)
    assert streamed.usage() == kept.usage()
    assert streamed.choices[0].token_ids == [] and not streamed.choices[0]._parts
    assert streamed.choices[0]._logprobs.tokens == []
    with pytest.raises(AnswerNotKept):
        streamed.response()
