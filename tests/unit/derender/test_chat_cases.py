"""DERENDER_CASES on the chat derender, with the real Qwen3 tokenizer.

Each test names the case it covers. Streams are fed the way an engine sends
them (one step per chunk, the finish on the last one) and folded back.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.errors import TokenIdOutOfRange
from derender.text import TextParams
from derender.vocab import TokenVocab
from engine.qwen3.vocab import IM_END_ID, THINK_END_ID, THINK_START_ID, TOOL_CALL_START_ID
from tests.support.streams import comparable_response, fixed, parsed_arguments, random_splits, stream, whole

TOOLS_ON = ChatOptions(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True)
REASONING_ONLY = ChatOptions(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=False)
PLAIN = ChatOptions()

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris 🫠", "days": [1, 2]}}\n</tool_call>'
CLOCK = '<tool_call>\n{"name": "get_time"}\n</tool_call>'
REASONED = f"<think>\nThe user wants weather 世界 🫠𓀀.\nCheck it.\n</think>\n\nLet me look that up.\n{WEATHER}\n{CLOCK}"


@pytest.fixture
def enc(qwen3_tokenizer: Any) -> Any:
    return lambda text: qwen3_tokenizer.encode(text)


def options(base: ChatOptions, **text: Any) -> ChatOptions:
    from dataclasses import replace

    return replace(base, text=TextParams(**text))


# -- the master test ----------------------------------------------------------


@pytest.mark.parametrize("sizes", [fixed(k) for k in range(1, 9)] + [random_splits(seed) for seed in range(6)])
def test_master_rechunking_equals_non_streaming(qwen3_vocab: TokenVocab, enc: Any, sizes: Any) -> None:
    from dataclasses import replace

    opts = replace(TOOLS_ON, logprobs=True, top_logprobs=2)
    ids = [*enc(REASONED), IM_END_ID]
    reference = comparable_response(whole(qwen3_vocab, opts, ids, with_logprobs=True))
    run = stream(qwen3_vocab, opts, ids, sizes, with_logprobs=True)
    folded = run.folded
    assert folded.as_comparable() == reference
    assert folded.role == "assistant"
    assert reference["reasoning"] == "\nThe user wants weather 世界 🫠𓀀.\nCheck it.\n"
    assert reference["content"] == "\n\nLet me look that up."  # the line break before the call is dropped
    assert parsed_arguments(folded) == [{"city": "Paris 🫠", "days": [1, 2]}, {}]
    assert reference["finish_reason"] == "tool_calls"
    assert len(folded.logprobs) == len(ids)
    assert all(len(entry["top_logprobs"]) == 2 for entry in folded.logprobs)
    assert "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in folded.logprobs[:3]).startswith("<think>")
    assert folded.usage.completion_tokens == len(ids)
    # Reasoning tokens: everything strictly between the markers.
    inner = ids[ids.index(THINK_START_ID) + 1 : ids.index(THINK_END_ID)]
    assert folded.usage.completion_tokens_details.reasoning_tokens == len(inner)


# -- 1. multi-byte UTF-8 ------------------------------------------------------


def test_no_replacement_character_in_any_delta(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("🫠𓀀🧬 䨻 done")
    folded = stream(qwen3_vocab, PLAIN, ids).folded
    assert folded.content == "🫠𓀀🧬 䨻 done"
    assert all("\ufffd" not in (d.get("content") or "") for d in folded.deltas)


def test_genuine_replacement_character_and_cut_character(qwen3_vocab: TokenVocab, enc: Any) -> None:
    assert stream(qwen3_vocab, PLAIN, enc("a\ufffdb")).folded.content == "a\ufffdb"
    cut = enc("ok 🫠")[:-1]
    folded = stream(qwen3_vocab, PLAIN, cut, finish_reason="length").folded
    assert folded.content == "ok"  # flush policy: an unfinished character is dropped, its space with it


def cut_inside_last_character(tokenizer: Any, text: str) -> list[int]:
    """The ids of `text` cut as `max_tokens` would, inside its last (multi-byte) character."""
    ids = tokenizer.encode(text)
    cut = max(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    return ids[:cut]


CUT_CASES: dict[str, tuple[str, dict[str, str | None]]] = {
    "content": ("<think>\nok\n</think>\n\nSee 世界 🫠", {"reasoning": "\nok\n", "content": "\n\nSee 世界"}),
    "reasoning": ("<think>\nThe weather 🫠", {"reasoning": "\nThe weather", "content": None}),
    "arguments": (
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris 🫠',
        {"reasoning": "\nok\n", "arguments": '{"city": "Paris"}'},  # and the cut call closed to JSON
    ),
}


@pytest.mark.parametrize("where", list(CUT_CASES))
def test_length_cut_inside_a_character_leaves_no_replacement(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, where: str
) -> None:
    """Issue #27: `max_tokens` ending inside a character, in content, reasoning or tool
    arguments, streamed and not: the character and its space are dropped, no U+FFFD."""
    text, expected = CUT_CASES[where]
    ids = cut_inside_last_character(qwen3_tokenizer, text)
    answers = [comparable_response(whole(qwen3_vocab, TOOLS_ON, ids, finish_reason="length"))]
    for sizes in (fixed(1), fixed(3)):
        answers.append(stream(qwen3_vocab, TOOLS_ON, ids, sizes, finish_reason="length").folded.as_comparable())
    for answer in answers:
        assert "\ufffd" not in json.dumps(answer, ensure_ascii=False)
        assert answer["reasoning"] == expected["reasoning"]
        if "content" in expected:
            assert answer["content"] == expected["content"]
        if "arguments" in expected:
            assert [call["arguments"] for call in answer["tool_calls"]] == [expected["arguments"]]


# -- 3. out-of-range ids ------------------------------------------------------


def test_out_of_range_id_raises_before_any_state_changes(qwen3_vocab: TokenVocab, enc: Any) -> None:
    derender = ChatDerender(qwen3_vocab, TOOLS_ON, model="m")
    derender.step(0, enc("<think>ok"))
    with pytest.raises(TokenIdOutOfRange):
        derender.step(0, [151_700])
    chunk = derender.step(0, enc(" fine"), finish_reason="length")
    assert chunk is not None and chunk.choices[0].delta.reasoning == " fine"


# -- 4. stop strings ------------------------------------------------------------


def test_stop_string_across_tokens_is_never_streamed(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("Hello world, the end. More text")
    opts = options(PLAIN, stop=("the end",))
    run = stream(qwen3_vocab, opts, ids, finish_reason="length")
    folded = run.folded
    assert folded.content == "Hello world, "
    assert all("the end" not in (d.get("content") or "") for d in folded.deltas)
    assert (folded.finish_reason, folded.stop_reason) == ("stop", "the end")
    kept = run.derender.choices[0].token_ids
    assert qwen3_vocab.backend.decode(kept).endswith("the end")  # ids keep the stop's tokens
    assert len(kept) < len(ids)


def test_stop_string_inside_one_token(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("a wonderful day")
    assert any(qwen3_vocab.piece(i)[0] == " wonderful" for i in ids)
    folded = stream(qwen3_vocab, options(PLAIN, stop=("der",)), ids, finish_reason="length").folded
    assert folded.content == "a won"
    assert folded.stop_reason == "der"


def test_include_stop_str_in_output(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("one two three four")
    folded = stream(
        qwen3_vocab, options(PLAIN, stop=(" three",), include_stop_str_in_output=True), ids, finish_reason="length"
    ).folded
    assert folded.content == "one two three"


def test_only_a_live_partial_match_is_held(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("Alpha beta gamma delta")
    run = stream(qwen3_vocab, options(PLAIN, stop=("STOP_SEQUENCE_THAT_NEVER_OCCURS",)), ids, finish_reason="length")
    contents = [d.get("content") for d in run.folded.deltas[1:]]
    # No fixed-width hold-back: every token's text goes out in its own chunk.
    assert contents == [qwen3_vocab.piece(i)[0] for i in ids]


def test_held_partial_match_released_at_finish(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("result: the e")
    run = stream(qwen3_vocab, options(PLAIN, stop=("the end",)), ids, finish_reason="length")
    assert run.folded.content == "result: the e"
    assert run.folded.finish_reason == "length"
    assert run.folded.deltas[-1].get("content", "").endswith("e")  # released with the finish


# -- 5. markers are never separated from their ids -----------------------------


def test_hold_back_keeps_marker_with_its_id(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = [*enc("<think>\nhmm\n</think>\n\nanswer"), IM_END_ID]
    plain = comparable_response(whole(qwen3_vocab, REASONING_ONLY, ids))
    # "</think>" is a live prefix of this stop string, so its piece is held whole and released later.
    held = options(REASONING_ONLY, stop=("</think>NEVER",))
    for k in (1, 2, 3):
        folded = stream(qwen3_vocab, held, ids, fixed(k)).folded
        assert folded.as_comparable() == plain
        assert "<thin" not in folded.content and "</think>" not in (folded.reasoning + folded.content)


def test_stop_string_keeps_partial_tool_call(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = [*enc('<tool_call>\n{"name": "f", "arguments": {"q": "alpha STOP beta"}}\n</tool_call>'), IM_END_ID]
    opts = options(TOOLS_ON, stop=("STOP",))
    folded = stream(qwen3_vocab, opts, ids, prompt_ids=enc("</think>\n\n")).folded
    assert folded.tool_calls[0]["name"] == "f"
    assert folded.tool_calls[0]["arguments"] == '{"q": "alpha "}'  # closed to valid JSON (issue #27)
    assert (folded.finish_reason, folded.stop_reason) == ("stop", "STOP")


# -- 6. multi-token steps -------------------------------------------------------


def test_markers_grouped_with_text_in_one_step(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = [*enc("<think>why</think>\n\nSure<tool_call>\n" + '{"name": "f", "arguments": {"a": 1}}\n</tool_call>'), IM_END_ID]
    think_end = ids.index(THINK_END_ID)
    tool_start = ids.index(TOOL_CALL_START_ID)
    derender = ChatDerender(qwen3_vocab, TOOLS_ON, model="m")
    first = derender.step(0, ids[:think_end])  # "<think>" grouped with text
    second = derender.step(0, ids[think_end : tool_start + 2])  # "</think>" and "<tool_call>" in one delta
    last = derender.step(0, ids[tool_start + 2 :], finish_reason="stop")  # "}}\n" closes args and call at once
    assert first is not None and first.choices[0].delta.reasoning == "why"
    assert second is not None
    assert second.choices[0].delta.content == "\n\nSure"
    assert second.choices[0].delta.reasoning is msgspec.UNSET
    assert last is not None and last.choices[0].finish_reason == "tool_calls"
    calls = (second.choices[0].delta.tool_calls or []) + (last.choices[0].delta.tool_calls or [])
    arguments = "".join(c.function.arguments or "" for c in calls if c.function)
    assert json.loads(arguments) == {"a": 1}


# -- 7. several stop strings in one step ------------------------------------------


def test_earliest_stop_wins_and_later_ids_are_dropped(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("x alpha beta gamma delta epsilon")
    from dataclasses import replace

    opts = replace(options(PLAIN, stop=("gamma", " beta", "delta")), logprobs=True)
    run = stream(qwen3_vocab, opts, ids, fixed(len(ids)), with_logprobs=True, finish_reason="length")
    folded = run.folded
    assert folded.content == "x alpha"
    assert folded.stop_reason == " beta"
    kept = run.derender.choices[0].token_ids
    assert qwen3_vocab.backend.decode(kept) == "x alpha beta"
    assert len(folded.logprobs) == len(kept)


def test_stop_ending_at_same_place_prefers_list_order(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("say hello world now")
    folded = stream(qwen3_vocab, options(PLAIN, stop=("o world", "world")), ids, fixed(len(ids))).folded
    assert folded.stop_reason == "o world"
    assert folded.content == "say hell"


def test_min_tokens_suppresses_early_stops(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("stop here, then stop again")
    early = stream(qwen3_vocab, options(PLAIN, stop=("stop",)), ids, finish_reason="length").folded
    assert early.content == ""
    late = stream(qwen3_vocab, options(PLAIN, stop=("stop",), min_tokens=2), ids, finish_reason="length").folded
    assert late.content == "stop here, then "


# -- 8. token ids versus text ---------------------------------------------------


def test_token_route_reproduces_engine_text(qwen3_vocab: TokenVocab, enc: Any) -> None:
    """The engine stops on a string and returns every id up to it; re-derendering them gives the same text."""
    ids = enc("<think>plan</think>\n\nThe answer is 42. END of story")
    opts = options(REASONING_ONLY, stop=("END",))
    engine_side = stream(qwen3_vocab, opts, ids, finish_reason="length")
    returned_ids = engine_side.derender.choices[0].token_ids
    gateway_side = stream(qwen3_vocab, opts, returned_ids, fixed(3), finish_reason="stop", stop_reason="END")
    assert gateway_side.folded.as_comparable() == engine_side.folded.as_comparable()
    assert gateway_side.folded.content == "\n\nThe answer is 42. "


@pytest.mark.parametrize("skip", [True, False])
def test_eos_text_never_reaches_content(qwen3_vocab: TokenVocab, enc: Any, skip: bool) -> None:
    opts = options(REASONING_ONLY, skip_special_tokens=skip)
    ids = [*enc("hi there"), IM_END_ID]
    folded = stream(qwen3_vocab, opts, ids, prompt_ids=enc("<think>\n\n</think>\n\n")).folded
    assert folded.content == "hi there"
    assert folded.finish_reason == "stop" and folded.stop_reason is None
    non_stream = comparable_response(whole(qwen3_vocab, opts, ids, prompt_ids=enc("<think>\n\n</think>\n\n")))
    assert non_stream["content"] == "hi there"


def test_stop_token_id_excluded_from_text(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("abc def")
    folded = stream(qwen3_vocab, PLAIN, ids, finish_reason="stop", stop_reason=ids[-1]).folded
    assert folded.content == qwen3_vocab.backend.decode(ids[:-1])
    assert folded.stop_reason == ids[-1]


# -- 9. finish flush ------------------------------------------------------------


@pytest.mark.parametrize("tail", ["<", "<tool_", "</thi", "the e"])
def test_held_tails_released_at_finish(qwen3_vocab: TokenVocab, enc: Any, tail: str) -> None:
    ids = enc("</think>\n\nvalue " + tail)
    opts = options(TOOLS_ON, stop=("the end", "<tool_x", "</this"))
    folded = stream(qwen3_vocab, opts, ids, finish_reason="length", final_empty_chunk=True).folded
    assert folded.content == "\n\nvalue " + tail
    assert folded.finish_reason == "length"


def test_final_chunk_without_tokens_carries_finish(qwen3_vocab: TokenVocab, enc: Any) -> None:
    derender = ChatDerender(qwen3_vocab, options(PLAIN, stop=("xyz",)), model="m")
    derender.step(0, enc("ab x"))
    chunk = derender.step(0, [], finish_reason="length")
    assert chunk is not None
    assert chunk.choices[0].delta.content == "x"
    assert chunk.choices[0].finish_reason == "length"


def test_truncated_tool_call_under_max_tokens(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc('</think>\n\n<tool_call>\n{"name":"f","argu')
    for k in (1, 4):
        folded = stream(qwen3_vocab, TOOLS_ON, ids, fixed(k), finish_reason="length").folded
        assert [c["name"] for c in folded.tool_calls] == ["f"]
        assert folded.tool_calls[0]["arguments"] == "{}"  # cut before any argument text (issue #27)
        assert folded.finish_reason == "length"
    nameless = enc('</think>\n\n<tool_call>\n{"na')
    folded = stream(qwen3_vocab, TOOLS_ON, nameless, finish_reason="length").folded
    assert folded.tool_calls == []
    assert folded.content == '\n\n<tool_call>\n{"na'  # never a call: nothing is lost


# -- 10. tool arguments ---------------------------------------------------------


@pytest.mark.parametrize("sizes", [fixed(1), fixed(2), fixed(5), random_splits(11), random_splits(12)])
def test_tool_calls_headers_ids_and_arguments(qwen3_vocab: TokenVocab, enc: Any, sizes: Any) -> None:
    body = f"{WEATHER}\n{CLOCK}\n" + '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" {x}"}}\n</tool_call>'
    ids = [*enc("</think>\n\n" + body), IM_END_ID]
    run = stream(qwen3_vocab, TOOLS_ON, ids, sizes)
    folded = run.folded
    headers = [c for d in folded.deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [h["index"] for h in headers] == [0, 1, 2]
    assert all(h["type"] == "function" and h["id"].startswith("chatcmpl-tool-") for h in headers)
    assert len({h["id"] for h in headers}) == 3
    assert parsed_arguments(folded) == [{"city": "Paris 🫠", "days": [1, 2]}, {}, {"q": 'a "quoted" {x}'}]
    assert folded.content is None or folded.content == ""
    assert folded.finish_reason == "tool_calls"
    assert folded.as_comparable() == comparable_response(whole(qwen3_vocab, TOOLS_ON, ids))


def test_parallel_tool_calls_false_keeps_first(qwen3_vocab: TokenVocab, enc: Any) -> None:
    from dataclasses import replace

    ids = [*enc(f"</think>\n\n{WEATHER}\n{CLOCK}"), IM_END_ID]
    folded = stream(qwen3_vocab, replace(TOOLS_ON, parallel_tool_calls=False), ids).folded
    assert [c["name"] for c in folded.tool_calls] == ["get_weather"]


# -- 11. skip_special_tokens and tools on/off --------------------------------------


def test_no_tool_parsing_without_tools(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = [*enc(f"<think>x</think>\n\n{CLOCK}"), IM_END_ID]
    folded = stream(qwen3_vocab, REASONING_ONLY, ids).folded
    assert folded.tool_calls == []
    assert folded.content == f"\n\n{CLOCK}"
    assert folded.finish_reason == "stop"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_with_tools(qwen3_vocab: TokenVocab, enc: Any, skip: bool) -> None:
    ids = [*enc(f"<think>x</think>\n\n{CLOCK}<|endoftext|>"), IM_END_ID]
    folded = stream(qwen3_vocab, options(TOOLS_ON, skip_special_tokens=skip), ids).folded
    assert [c["name"] for c in folded.tool_calls] == ["get_time"]
    assert folded.content == ("" if skip else "<|endoftext|>")  # text after a call is kept, never lost
    plain = stream(qwen3_vocab, options(PLAIN, skip_special_tokens=skip), enc("a<|endoftext|>b")).folded
    assert plain.content == ("ab" if skip else "a<|endoftext|>b")


# -- 12. initial reasoning state from the prompt --------------------------------------


def _prompt(tokenizer: Any, **kwargs: Any) -> list[int]:
    messages = [{"role": "user", "content": "hi"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]


def test_enable_thinking_false_makes_everything_content(qwen3_vocab: TokenVocab, qwen3_tokenizer: Any, enc: Any) -> None:
    from dataclasses import replace

    prompt = _prompt(qwen3_tokenizer, enable_thinking=False)
    assert prompt[-5:-1].count(THINK_END_ID) == 1 or THINK_END_ID in prompt[-6:]
    opts = replace(REASONING_ONLY, enable_thinking=False)
    folded = stream(qwen3_vocab, opts, [*enc("just an answer"), IM_END_ID], prompt_ids=prompt).folded
    assert (folded.reasoning, folded.content) == ("", "just an answer")
    assert folded.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_prompt_starts_in_reasoning(qwen3_vocab: TokenVocab, qwen3_tokenizer: Any, enc: Any) -> None:
    prompt = _prompt(qwen3_tokenizer)
    folded = stream(qwen3_vocab, REASONING_ONLY, [*enc("<think>\nhmm\n</think>\n\nok"), IM_END_ID], prompt_ids=prompt).folded
    assert (folded.reasoning, folded.content) == ("\nhmm\n", "\n\nok")


def test_pre_opened_think_starts_in_reasoning(qwen3_vocab: TokenVocab, enc: Any) -> None:
    from dataclasses import replace

    prompt = enc("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    opts = replace(REASONING_ONLY, enable_thinking=False)  # the prompt wins over the flag
    folded = stream(qwen3_vocab, opts, [*enc("deep thought</think>\n\nok"), IM_END_ID], prompt_ids=prompt).folded
    assert (folded.reasoning, folded.content) == ("deep thought", "\n\nok")


def test_earlier_turns_do_not_set_the_state(qwen3_vocab: TokenVocab, enc: Any) -> None:
    prompt = enc("<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n")
    folded = stream(qwen3_vocab, REASONING_ONLY, enc("<think>new</think>ok"), prompt_ids=prompt).folded
    assert (folded.reasoning, folded.content) == ("new", "ok")


# -- 13. priming with a prompt that ends mid-character -----------------------------------


def test_prompt_ending_mid_character(qwen3_vocab: TokenVocab, enc: Any) -> None:
    ids = enc("x🫠")
    prompt, output = ids[:2], ids[2:]
    folded = stream(qwen3_vocab, PLAIN, output, prompt_ids=prompt, finish_reason="length").folded
    assert "x" not in folded.content
    assert folded.content == qwen3_vocab.backend.decode(output)


# -- options and shape -----------------------------------------------------------------


def test_reasoning_field_alias_and_include_reasoning(qwen3_vocab: TokenVocab, enc: Any) -> None:
    from dataclasses import replace

    ids = [*enc("<think>why</think>ok"), IM_END_ID]
    alias = whole(qwen3_vocab, replace(REASONING_ONLY, reasoning_field="reasoning_content"), ids)
    message = alias.choices[0].message
    assert (message.reasoning_content, message.reasoning) == ("why", None)
    both = stream(qwen3_vocab, replace(REASONING_ONLY, reasoning_field="both"), ids).folded
    assert any(d.get("reasoning_content") == "why" and d.get("reasoning") == "why" for d in both.deltas)
    hidden = whole(qwen3_vocab, replace(REASONING_ONLY, include_reasoning=False), ids).choices[0].message
    assert (hidden.reasoning, hidden.content) == (None, "ok")


def test_first_chunk_is_the_role(qwen3_vocab: TokenVocab, enc: Any) -> None:
    import msgspec

    run = stream(qwen3_vocab, PLAIN, enc("hey"))
    first = msgspec.json.decode(msgspec.json.encode(run.chunks[0]))
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    assert first["object"] == "chat.completion.chunk"
