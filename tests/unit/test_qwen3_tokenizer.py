"""The offline Qwen3 tokenizer matches the real one: IDs, round trips, template."""

from __future__ import annotations

import base64
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.qwen3.fixtures import chat_template
from engine.qwen3.vocab import QWEN_PATTERN, ranks_path

# Qwen3's added tokens as published with its checkpoints: ID, text, special.
QWEN3_ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

_RAW_CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:30 and we'll see 1234567 items.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "if (x != y && z >= 0) { printf(\"%d\\n\", x); }\r\n\treturn;",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, skin tones 👍🏽.",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030a",
    "ZWJ and marks: a\u0332b\u0332 \u0915\u094d\u0937 \u05e9\u05c1\u05b8",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand  double  spaces\u00a0nbsp\u3000ideographic",
    "\n\nblank lines\n\n\n\nand a final newline\n",
    "MiXeD CaSe DON'T I'M YOU'LL they'RE",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ → ∂x",
    "\x00\x01 control\x7f bytes \u200b zero-width",
    "https://example.invalid/path?q=1&r=%20#frag",
    "inline <think>markers</think> and <tool_call>{}</tool_call><|im_end|>",
]
# The tokenizer normalises to NFC first, so only NFC text can come back byte-exact.
CORPUS = [unicodedata.normalize("NFC", text) for text in _RAW_CORPUS]

MARKERS = {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658}


def _tiktoken_encoding() -> tiktoken.Encoding:
    # Parsed here rather than via load_tiktoken_bpe, which copies files into a temp cache.
    ranks: dict[bytes, int] = {}
    for line in ranks_path().read_text(encoding="ascii").splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    specials = {text: token_id for token_id, text, _ in QWEN3_ADDED_TOKENS}
    return tiktoken.Encoding("qwen3-reference", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    return _tiktoken_encoding()


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- the folder and its special tokens --------------------------------------


def test_folder_loads_offline_as_fast_tokenizer(qwen3_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir, local_files_only=True)
    assert tokenizer.is_fast
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"


def test_vocabulary_size(qwen3_tokenizer: Any) -> None:
    assert len(qwen3_tokenizer) == 151_669


def test_added_tokens_are_qwen3s(qwen3_tokenizer: Any) -> None:
    found = [(i, t.content, t.special) for i, t in sorted(qwen3_tokenizer.added_tokens_decoder.items())]
    assert found == QWEN3_ADDED_TOKENS


def test_eos_pad_and_no_bos(qwen3_tokenizer: Any) -> None:
    assert (qwen3_tokenizer.eos_token, qwen3_tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (qwen3_tokenizer.pad_token, qwen3_tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert qwen3_tokenizer.bos_token is None
    assert qwen3_tokenizer.encode("hi") == qwen3_tokenizer.encode("hi", add_special_tokens=False)


def test_generation_config_stops_on_both_markers(qwen3_tokenizer_dir: Path) -> None:
    config = json.loads((qwen3_tokenizer_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == [151645, 151643]
    assert config["pad_token_id"] == 151643


@pytest.mark.parametrize(("text", "token_id"), MARKERS.items())
def test_marker_is_one_token(qwen3_tokenizer: Any, text: str, token_id: int) -> None:
    assert qwen3_tokenizer.encode(text) == [token_id]
    ids = qwen3_tokenizer.encode(f"before{text}after")
    assert ids.count(token_id) == 1


def test_markers_survive_skip_special_tokens(qwen3_tokenizer: Any) -> None:
    ids = qwen3_tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"


def test_known_ids(qwen3_tokenizer: Any) -> None:
    # Hello / " world" are stable anchors across the whole Qwen2 family.
    assert qwen3_tokenizer.encode("Hello world") == [9707, 1879]


# --- round trips and agreement with tiktoken --------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip_corpus(qwen3_tokenizer: Any, text: str) -> None:
    assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_tiktoken(qwen3_tokenizer: Any, reference: tiktoken.Encoding, text: str) -> None:
    assert qwen3_tokenizer.encode(text) == reference.encode(text, allowed_special="all")


def test_nfc_applied_before_bpe(qwen3_tokenizer: Any) -> None:
    decomposed = "Cafe\u0301"
    assert qwen3_tokenizer.encode(decomposed) == qwen3_tokenizer.encode("Caf\u00e9")


_nfc_text = st.text(max_size=80).map(lambda s: unicodedata.normalize("NFC", s))


@settings(max_examples=150, deadline=None)
@given(text=_nfc_text)
def test_round_trip_property(qwen3_tokenizer: Any, text: str) -> None:
    assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text)) == text


@settings(max_examples=150, deadline=None)
@given(text=_nfc_text)
def test_ids_match_tiktoken_property(qwen3_tokenizer: Any, reference: tiktoken.Encoding, text: str) -> None:
    # Hypothesis also feeds in string constants it finds in this module, such
    # as the added tokens, so both sides must treat those as single tokens.
    assert qwen3_tokenizer.encode(text) == reference.encode(text, allowed_special="all")


# --- chat template -----------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def test_template_comes_from_the_folder(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    assert (qwen3_tokenizer_dir / "chat_template.jinja").read_text() == chat_template()
    assert qwen3_tokenizer.chat_template == chat_template()


def test_system_user_assistant_turns(qwen3_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert _render(qwen3_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_no_generation_prompt_by_default(qwen3_tokenizer: Any) -> None:
    assert _render(qwen3_tokenizer, [{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_content_parts_are_joined(qwen3_tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "one "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "two"}]
    assert _render(qwen3_tokenizer, [{"role": "user", "content": parts}]) == "<|im_start|>user\none two<|im_end|>\n"


def test_thinking_disabled_prefills_empty_think(qwen3_tokenizer: Any) -> None:
    rendered = _render(qwen3_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    enabled = _render(qwen3_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=True)
    assert enabled.endswith("<|im_start|>assistant\n")


def test_tools_block_merges_into_system(qwen3_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    rendered = _render(qwen3_tokenizer, messages, tools=[WEATHER_TOOL, CLOCK_TOOL])
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    tool_lines = f"<tools>\n{json.dumps(WEATHER_TOOL)}\n{json.dumps(CLOCK_TOOL)}\n</tools>"
    assert tool_lines in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert rest == "<|im_start|>user\nWeather?<|im_end|>\n"


def test_tools_without_system_get_their_own(qwen3_tokenizer: Any) -> None:
    rendered = _render(qwen3_tokenizer, [{"role": "user", "content": "Hi"}], tools=[CLOCK_TOOL])
    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    assert rendered.count("<|im_start|>system") == 1


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}], ids=["json-string", "dict"])
def test_assistant_tool_calls(qwen3_tokenizer: Any, arguments: str | dict[str, str]) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call, {"function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "content": "noon"},
        {"role": "assistant", "content": "18C at noon."},
    ]
    assert _render(qwen3_tokenizer, messages) == (
        "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n18C at noon.<|im_end|>\n"
    )


def test_tool_call_without_content_starts_the_turn(qwen3_tokenizer: Any) -> None:
    call = {"function": {"name": "now", "arguments": "{}"}}
    rendered = _render(qwen3_tokenizer, [{"role": "user", "content": "t?"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert rendered.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_reasoning_kept_only_after_last_query(qwen3_tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "", "reasoning": "new thoughts", "tool_calls": [{"function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "content": "noon"},
        {"role": "assistant", "content": "A2", "reasoning_content": "\nfinal thoughts\n"},
    ]
    rendered = _render(qwen3_tokenizer, messages)
    assert "old thoughts" not in rendered
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in rendered
    assert '<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\n<tool_call>\n{"name": "now"' in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\nfinal thoughts\n</think>\n\nA2<|im_end|>\n")


def test_inline_think_in_content_is_split_out(qwen3_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nearly\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nlate\n</think>\n\nA2"},
    ]
    rendered = _render(qwen3_tokenizer, messages)
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\nlate\n</think>\n\nA2<|im_end|>\n")


def test_rendered_prompt_tokenizes_markers_as_single_ids(qwen3_tokenizer: Any) -> None:
    rendered = _render(qwen3_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False)
    ids = qwen3_tokenizer.encode(rendered)
    assert ids[0] == 151644
    assert ids[-4:] == [151667, 271, 151668, 271]
