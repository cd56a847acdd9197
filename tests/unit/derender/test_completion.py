"""Completions derender: the chat pipeline's text, in the legacy completion shape."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from derender.completion import CompletionDerender, CompletionOptions
from derender.text import TextParams
from derender.vocab import TokenVocab
from wire.openai_schema import CompletionRequest
from tests.support.streams import fake_logprobs

TEXT = "Once upon a time 🫠 there was a parser. THE END and more"


def run(vocab: TokenVocab, options: CompletionOptions, ids: list[int], width: int, **kwargs: Any) -> tuple[list, CompletionDerender]:
    derender = CompletionDerender(vocab, options, model="m", include_usage=True, **kwargs)
    logprobs = fake_logprobs(ids)
    chunks = []
    for start in range(0, len(ids), width):
        last = start + width >= len(ids)
        chunk = derender.step(0, ids[start : start + width], logprobs[start : start + width], finish_reason="length" if last else None)
        if chunk is not None:
            chunks.append(chunk)
        if derender.finished:
            break
    return chunks, derender


@pytest.mark.parametrize("width", [1, 2, 3, 7, 100])
def test_rechunking_gives_the_same_completion(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, width: int) -> None:
    ids = qwen3_tokenizer.encode(TEXT)
    options = CompletionOptions(text=TextParams(stop=("THE END",)), logprobs=2)
    chunks, derender = run(qwen3_vocab, options, ids, width)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "Once upon a time 🫠 there was a parser. "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == "THE END"
    response = derender.response()
    assert response.choices[0].text == text
    lp = response.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(derender.choices[0].token_ids)
    # Keyed by decoded string, as the legacy format is: two byte tokens can collide on U+FFFD.
    assert all(top is not None and 1 <= len(top) <= 2 for top in lp.top_logprobs)
    # Offsets are positions in the text, each token starting where the previous one ended.
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert response.usage.completion_tokens == len(derender.choices[0].token_ids)


def test_echo_prepends_the_prompt(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    prompt = qwen3_tokenizer.encode("Q: why?")
    ids = qwen3_tokenizer.encode(" A: because.")
    options = CompletionOptions(echo=True)
    derender = CompletionDerender(qwen3_vocab, options, model="m", prompt_token_ids=prompt)
    derender.step(0, ids, finish_reason="length")
    assert derender.response().choices[0].text == "Q: why? A: because."
    assert derender.response().usage.prompt_tokens == len(prompt)


def test_choices_are_numbered_across_prompts(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    derender = CompletionDerender(qwen3_vocab, CompletionOptions(), model="m", n=2, first_index=4)
    chunk = derender.step(1, qwen3_tokenizer.encode("hi"), finish_reason="length")
    assert chunk is not None and chunk.choices[0].index == 5
    assert not derender.finished


def test_options_from_request() -> None:
    request = msgspec.json.decode(
        b'{"prompt": "x", "stop": "END", "logprobs": 3, "echo": true, "min_tokens": 2}', type=CompletionRequest
    )
    options = CompletionOptions.from_request(request)
    assert options.text.stop == ("END",)
    assert (options.logprobs, options.echo, options.text.min_tokens) == (3, True, 2)


def test_chunk_wire_shape(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab) -> None:
    derender = CompletionDerender(qwen3_vocab, CompletionOptions(), model="m")
    chunk = derender.step(0, qwen3_tokenizer.encode("hi"), finish_reason="length")
    body = msgspec.json.decode(msgspec.json.encode(chunk))
    assert body["object"] == "text_completion"
    assert body["choices"][0] == {
        "index": 0,
        "text": "hi",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }
