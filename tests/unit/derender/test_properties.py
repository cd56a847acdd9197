"""Property tests: random token streams, random chunkings, one answer."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from derender.chat import ChatOptions
from derender.text import TextParams, TextPipeline
from derender.vocab import TokenVocab
from engine.qwen3.vocab import IM_END_ID, THINK_END_ID, THINK_START_ID, TOOL_CALL_END_ID, TOOL_CALL_START_ID
from tests.support.streams import comparable_response, parsed_arguments, random_splits, stream, whole

WORDS = ["hello", " world", " 世界", "🫠", "𓀀", " 🧬", "䨻", "<", "</", "thi", "nk>", " the", " end", "\n\n", " ", "{", "}", '"']
STOP_CHOICES = st.sampled_from([" the end", "🫠", "nk>", "</thi", "world 世", "\n\n\n"])
STOPS = st.lists(STOP_CHOICES, max_size=2)
MARKERS = [THINK_START_ID, THINK_END_ID, TOOL_CALL_START_ID, TOOL_CALL_END_ID, IM_END_ID]
# ONEHOP_PROPERTY_EXAMPLES=3000 runs a deeper search locally; CI keeps the default short.
# Derandomized: the suite gives the same verdict on every run (CI must be reproducible);
# ONEHOP_PROPERTY_RANDOM=1 explores new examples.
SETTINGS = settings(
    max_examples=int(os.environ.get("ONEHOP_PROPERTY_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not os.environ.get("ONEHOP_PROPERTY_RANDOM"),
)


@st.composite
def token_streams(draw: Any, tokenizer: Any) -> list[int]:
    """Words (multi-byte ones split over byte tokens), bare markers, and well-formed tool calls."""
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["word", "word", "word", "marker", "call"]))
        if kind == "word":
            ids += tokenizer.encode(draw(st.sampled_from(WORDS)))
        elif kind == "marker":
            ids.append(draw(st.sampled_from(MARKERS[:-1])))
        else:
            ids += tokenizer.encode(_call_text(draw))
    if draw(st.booleans()):
        ids.append(IM_END_ID)
    return ids


def _call_text(draw: Any) -> str:
    arguments = draw(
        st.dictionaries(
            st.sampled_from(["city", "q", "n", "文"]),
            st.one_of(st.integers(-5, 500), st.sampled_from(["Paris", 'a "q" }', "🫠 ok", ""]), st.booleans()),
            max_size=3,
        )
    )
    body = {"name": draw(st.sampled_from(["f", "get_weather"]))}
    if arguments or draw(st.booleans()):
        body["arguments"] = arguments
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


BASE = ChatOptions(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True, logprobs=True, top_logprobs=1)


@SETTINGS
@given(data=st.data(), stops=STOPS, tools=st.booleans(), thinking=st.booleans(), seed=st.integers(0, 10_000))
def test_any_chunking_equals_non_streaming(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, stops: list[str], tools: bool, thinking: bool, seed: int
) -> None:
    ids = data.draw(token_streams(qwen3_tokenizer))
    options = replace(BASE, tools_enabled=tools, enable_thinking=thinking, text=TextParams(stop=tuple(stops)))
    reference = comparable_response(whole(qwen3_vocab, options, ids, with_logprobs=True))
    for sizes in (random_splits(seed), random_splits(seed + 1, most=3)):
        folded = stream(qwen3_vocab, options, ids, sizes, with_logprobs=True).folded
        assert folded.as_comparable() == reference


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 10_000))
def test_well_formed_tool_calls_round_trip(qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, seed: int) -> None:
    count = data.draw(st.integers(1, 3))
    bodies = [json.loads(_call_text(data.draw).split("\n")[1]) for _ in range(count)]
    output = "</think>\n\n" + "\n".join(
        f"<tool_call>\n{json.dumps(b, ensure_ascii=False)}\n</tool_call>" for b in bodies
    )
    ids = [*qwen3_tokenizer.encode(output), IM_END_ID]
    folded = stream(qwen3_vocab, BASE, ids, random_splits(seed)).folded
    assert [c["name"] for c in folded.tool_calls] == [b["name"] for b in bodies]
    assert parsed_arguments(folded) == [b.get("arguments", {}) for b in bodies]
    assert folded.finish_reason == "tool_calls"
    assert not folded.content


@SETTINGS
@given(data=st.data(), stops=st.lists(STOP_CHOICES, min_size=1, max_size=2), include=st.booleans(), width=st.integers(1, 6))
def test_stop_strings_never_leak(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, stops: list[str], include: bool, width: int
) -> None:
    ids = data.draw(token_streams(qwen3_tokenizer))
    pipeline = TextPipeline(qwen3_vocab, TextParams(stop=tuple(stops), include_stop_str_in_output=include))
    pieces: list[str] = []
    hit = None
    for start in range(0, len(ids), width):
        last = start + width >= len(ids)
        step = pipeline.feed(ids[start : start + width], finish_reason="length" if last else None)
        pieces += [text for text, _ in step.pieces]
        if step.finish_reason is not None:
            hit = step.stop_reason
            break
    text = "".join(pieces)
    full = qwen3_tokenizer.decode(ids, skip_special_tokens=True)
    if hit is None:
        assert text == full
        assert not any(stop in text for stop in stops)
    else:
        assert isinstance(hit, str) and hit in stops
        if include:
            assert text.endswith(hit) and not any(stop in text[: -len(hit)] for stop in stops)
        else:
            assert not any(stop in text for stop in stops)
            assert full.startswith(text + hit)


ROUTE_WORDS = [w for w in WORDS if w not in ("</", "nk>")]  # no way to spell a marker without its token
MARKER_TEXTS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


@st.composite
def marker_free_streams(draw: Any, tokenizer: Any) -> list[int]:
    ids = draw(token_streams(tokenizer))
    text_ids = tokenizer.encode("".join(draw(st.lists(st.sampled_from(ROUTE_WORDS), max_size=6))))
    return text_ids + [i for i in ids if not _spells_marker(tokenizer, i)]


def _spells_marker(tokenizer: Any, token_id: int) -> bool:
    return tokenizer.decode([token_id]) in ("</", "nk>")


@SETTINGS
@given(data=st.data(), stops=STOPS, tools=st.booleans(), width=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_text_route_equals_token_route(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, data: Any, stops: list[str], tools: bool, width: int, seed: int
) -> None:
    """Engine `text` mode + gateway-side parsing gives the token route's answer."""
    from derender.chat import ChatDerender
    from derender.logprobs import chat_logprobs
    from tests.support.streams import counter_ids, default_finish, fake_logprobs, fold_chunks

    ids = data.draw(marker_free_streams(qwen3_tokenizer))
    # The text route finds markers by their text: marker text spelled by ordinary tokens
    # (`<` `th` `ink` `>`) is a marker there and plain text on the token route.
    assume(ids and not any(marker in qwen3_tokenizer.decode(ids) for marker in MARKER_TEXTS))
    options = replace(BASE, tools_enabled=tools, text=TextParams(stop=tuple(stops)))
    reference = stream(qwen3_vocab, options, ids, random_splits(seed), with_logprobs=True).folded
    # The engine's text mode: same pipeline, text deltas out.
    engine = TextPipeline(qwen3_vocab, options.text)
    gateway = ChatDerender(qwen3_vocab, options, model="m", include_usage=True, new_tool_call_id=counter_ids())
    chunks = gateway.start()
    logprobs = fake_logprobs(ids)
    finish = default_finish(ids)
    for start in range(0, len(ids), width):
        last = start + width >= len(ids)
        step = engine.feed(ids[start : start + width], finish_reason=finish if last else None)
        kept = ids[start : start + width][: step.kept]
        decoded = chat_logprobs(qwen3_vocab, logprobs[start : start + len(kept)], options.top_logprobs)
        chunk = gateway.step_text(
            0,
            "".join(text for text, _ in step.pieces),
            kept,
            decoded,
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
        )
        if chunk is not None:
            chunks.append(chunk)
        if step.finish_reason is not None:
            break
    usage = gateway.usage_chunk()
    assert usage is not None
    folded = fold_chunks([*chunks, usage])
    assert folded.as_comparable() == reference.as_comparable()
    assert folded.usage == reference.usage
