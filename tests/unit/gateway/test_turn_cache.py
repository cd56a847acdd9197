"""The turn cache gives the ids of tokenizing the whole rendered prompt, for every family's template.

Each family's tokenizer folder is loaded one at a time (a module-scoped parameter), and
one conversation is replayed turn by turn through it: reasoning that the template drops
once a later user query comes (Qwen3), consecutive tool results folded into one turn,
tools removed and added, an early turn edited, the conversation cut short. Every render
is checked against a plain encode of the template's text, with a cache large enough to
keep everything and with one small enough to evict on every turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from engine.qwen3.fixtures import ensure_tokenizer
from gateway.render.local import LocalRenderer, split_turns, turn_markers
from gateway.render.turn_cache import TurnCache, digest, entry_bytes
from tests.support import deepseek, kimi_k2, llama3, minimax_m2, mistral, pythonic
from gateway.render.token_ids import TokenIds
from tests.support.token_ids import id_list
from tests.support.glm_tokenizer import glm_tokenizer_dir
from tests.support.harmony_tokenizer import harmony_tokenizer
from tests.support.real_vocabularies import deepseek_dir, tekken_v3_dir
from wire.openai_schema import ChatCompletionRequest

FOLDERS: dict[str, Callable[[], Path]] = {
    "qwen3": ensure_tokenizer,  # hermes, qwen3_coder
    "deepseek": lambda: deepseek.deepseek_tokenizer_dir(ensure_tokenizer()),  # deepseek_v3, deepseek_v31
    "glm": glm_tokenizer_dir,  # glm45, glm47
    "kimi_k2": lambda: kimi_k2.kimi_tokenizer_dir(ensure_tokenizer()),
    "minimax_m2": lambda: minimax_m2.minimax_tokenizer_dir(ensure_tokenizer()),
    "mistral": lambda: mistral.mistral_tokenizer_dir(ensure_tokenizer()),
    "llama3_json": lambda: llama3.llama3_tokenizer_dir(ensure_tokenizer()),
    "openai": harmony_tokenizer,
    "pythonic": lambda: pythonic.pythonic_tokenizer_dir(ensure_tokenizer()),
    "deepseek-real": deepseek_dir,  # DeepSeek's own BPE
    "tekken-v3-real": tekken_v3_dir,  # Mistral's own BPE
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time now.",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
DROPPED_REASONING = "Second thoughts, 天气 in Zürich: call the tool."


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation() -> list[dict[str, Any]]:
    """Request bodies of one session, in order."""
    system = {"role": "system", "content": "You are terse. " + "Rules and context. " * 40}
    turns: list[list[dict[str, Any]]] = [[system, {"role": "user", "content": "Weather in Zürich? 🫠"}]]

    def more(*messages: dict[str, Any]) -> list[dict[str, Any]]:
        turns.append([*turns[-1], *messages])
        return turns[-1]

    more({"role": "assistant", "content": "Which day?", "reasoning_content": "Ask for the day."},
         {"role": "user", "content": "Today."})  # fmt: skip
    more({"role": "assistant", "content": "", "reasoning_content": DROPPED_REASONING,
          "tool_calls": [_call("c1", "get_weather", '{"city": "Zürich"}')]},
         {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'})  # fmt: skip
    more({"role": "assistant", "content": "21 °C.", "reasoning_content": "Answer."},
         {"role": "user", "content": "And the time there, and in Paris?"})  # fmt: skip
    more({"role": "assistant", "content": "", "tool_calls": [_call("c2", "get_time", '{"zone": "CET"}'),
          _call("c3", "get_time", '{"zone": "Europe/Paris"}')]},
         {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
         {"role": "tool", "tool_call_id": "c3", "content": "10:00"})  # fmt: skip
    bodies: list[dict[str, Any]] = [{"messages": messages, "tools": [WEATHER]} for messages in turns]
    last = turns[-1]
    bodies[-1]["tools"] = [WEATHER, CLOCK]  # a tool added mid-conversation
    bodies.append({"messages": last})  # every tool removed
    bodies.append({"messages": last, "tools": [CLOCK]})
    bodies.append({"messages": [last[0], {"role": "user", "content": "Weather in Bern?"}, *last[2:]], "tools": [CLOCK]})
    bodies.append({"messages": last[:4], "tools": [WEATHER]})  # cut short, as a client truncating
    bodies.append({"messages": last, "tools": [CLOCK], "chat_template_kwargs": {"enable_thinking": False}})
    return bodies


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request: pytest.FixtureRequest) -> Path:
    return FOLDERS[request.param]()


def _replay(renderer: LocalRenderer) -> list[str]:
    texts = []
    for body in conversation():
        request = msgspec.convert({"model": "m", **body}, ChatCompletionRequest)
        text = renderer.chat_text(request)
        whole = renderer.tokenizer.encode(text, add_special_tokens=False).ids
        assert id_list(renderer.chat_sync(request)) == whole
        assert id_list(renderer.chat_sync(request)) == whole  # all of it from the cache now
        texts.append(text)
    return texts


@pytest.mark.parametrize("budget", [64 * 1024 * 1024, 1024])
def test_cached_render_equals_a_plain_encode(folder: Path, budget: int) -> None:
    renderer = LocalRenderer(folder, workers=1, cache_bytes=budget)
    try:
        texts = _replay(renderer)
        assert renderer.cached_bytes <= budget
        if budget > 1024:
            assert renderer.turn_markers, "the family's turns are cut for the cache"
            assert len(renderer.turn_cache) > len(texts)
        if folder == ensure_tokenizer():  # Qwen3 rewrites history: reasoning before the latest query goes
            assert DROPPED_REASONING in texts[2] and DROPPED_REASONING not in texts[3]
            assert texts[4].count("<|im_start|>user") == texts[3].count("<|im_start|>user") + 1  # two results, one turn
    finally:
        renderer.close()


def test_an_edited_early_turn_is_never_served_from_the_cache() -> None:
    renderer = LocalRenderer(ensure_tokenizer(), workers=1)
    try:
        body = conversation()[4]
        first = msgspec.convert({"model": "m", **body}, ChatCompletionRequest)
        renderer.chat_sync(first)
        edited = msgspec.json.decode(msgspec.json.encode(first), type=ChatCompletionRequest)
        edited.messages[1].content = "Weather in Zürich? 🫡"  # one character of the first user turn
        ids = id_list(renderer.chat_sync(edited))
        assert ids == renderer.tokenizer.encode(renderer.chat_text(edited), add_special_tokens=False).ids
        assert ids != id_list(renderer.chat_sync(first))
    finally:
        renderer.close()


GLM_PARTS = ["<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "</think>", "<think>", "<tool_call>",
             " héllo", "🫠", "\n\n", "a\u0301", "  ", "x", "<|user", "|>"]  # fmt: skip


@pytest.fixture(scope="module")
def glm() -> Iterator[LocalRenderer]:
    renderer = LocalRenderer(glm_tokenizer_dir(), workers=1)
    yield renderer
    renderer.close()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(GLM_PARTS), max_size=24))
def test_cutting_before_any_of_several_markers_is_exact(glm: LocalRenderer, parts: list[str]) -> None:
    text = "".join(parts)
    assert id_list(glm.encode_sync(text)) == glm.tokenizer.encode(text, add_special_tokens=False).ids


def test_split_turns_cuts_before_every_marker() -> None:
    text = "<|system|>s<|user|>u<|assistant|>a<|user|>"
    assert split_turns(text, ("<|user|>", "<|assistant|>", "<|system|>")) == [
        "<|system|>s", "<|user|>u", "<|assistant|>a", "<|user|>"]  # fmt: skip
    assert split_turns("plain", ("<|user|>",)) == ["plain"]
    assert split_turns("", ("<|user|>",)) == []


def _qwen3_backend() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_tokenizer() / "tokenizer.json"))


def test_markers_that_would_make_a_cut_inexact_are_not_used() -> None:
    backend = _qwen3_backend()
    assert turn_markers(backend) == ("<|im_start|>",)
    backend.add_special_tokens([AddedToken("[INST]", lstrip=True, normalized=False)])  # takes the space before it
    backend.add_tokens([AddedToken("<|user|>", normalized=False), AddedToken("x<|user|>", normalized=False)])
    assert turn_markers(backend) == ("<|im_start|>",)
    backend.encode_special_tokens = True  # special tokens are then text: no cut before one is the tokenizer's
    assert turn_markers(backend) == ()


def _ids(*values: int) -> TokenIds:
    return TokenIds(values)


def test_the_cache_evicts_least_recently_used_within_its_budget() -> None:
    one = entry_bytes(_ids(*range(100)))
    cache = TurnCache(budget=8 * one)
    keys = [digest(f"segment {i}") for i in range(10)]
    cache.store((key, _ids(*range(100))) for key in keys[:8])
    assert cache.bytes == 8 * one and len(cache) == 8
    assert cache.lookup([keys[0]]) == [_ids(*range(100))]  # now the most recent
    cache.store((key, _ids(*range(100))) for key in keys[8:])
    assert cache.bytes <= cache.budget and len(cache) == 8
    assert [hit is not None for hit in cache.lookup(keys)] == [True, False, False, *[True] * 7]


def test_an_entry_over_an_eighth_of_the_budget_is_not_kept() -> None:
    cache = TurnCache(budget=8 * entry_bytes(_ids(*range(10))))
    cache.store([(digest("big"), _ids(*range(11))), (digest("small"), _ids(*range(10)))])
    assert digest("big") not in cache and digest("small") in cache


def test_a_zero_budget_keeps_nothing_and_renders_the_same() -> None:
    renderer = LocalRenderer(ensure_tokenizer(), workers=1, cache_bytes=0)
    try:
        _replay(renderer)
        assert len(renderer.turn_cache) == 0 and renderer.cached_bytes == 0
    finally:
        renderer.close()


def test_each_render_reports_its_tokens_from_the_cache_and_tokenized() -> None:
    """What `onehop_gateway_render_cache_tokens_total` counts: a new turn tokenizes only what the
    previous turn did not have; everything else comes from the cache."""
    reports: list[tuple[int, int]] = []
    renderer = LocalRenderer(ensure_tokenizer(), workers=1, on_cache=lambda hits, misses: reports.append((hits, misses)))
    try:
        system = {"role": "system", "content": "You are terse. " + "Rules. " * 40}
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": "First question, about caches."}]
        first = msgspec.convert({"model": "m", "messages": messages}, ChatCompletionRequest)
        before = len(renderer.chat_sync(first))
        messages += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "A second one."}]
        second = msgspec.convert({"model": "m", "messages": messages}, ChatCompletionRequest)
        after = len(renderer.chat_sync(second))
        renderer.encode_sync("plain text", add_special_tokens=True)  # not cut into turns: all of it tokenized
        plain = len(renderer.tokenizer.encode("plain text", add_special_tokens=True).ids)
        assert reports == [(0, before), (before, after - before), (0, plain)]
    finally:
        renderer.close()
