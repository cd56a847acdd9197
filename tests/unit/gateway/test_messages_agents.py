"""What Claude Code sends on `/v1/messages`: context edits, Anthropic's typed tools, mid-conversation
system messages, `cache_control` everywhere, the attribution line, effort, sampling extras, and
Anthropic's words for a prompt over the context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from wire.openai_schema import ChatCompletion, ChatCompletionChoice, ChatCompletionMessage, Usage
from gateway.config import Agents
from gateway.apis.context_edits import CLEARED
from gateway.edge.errors import InvalidRequest
from gateway.render.chat_template import ChatTemplate
from gateway.apis.messages import (
    ContextManagementResponse,
    MessagesPresenter,
    Translated,
    count_tokens_to_chat,
    decode_count_tokens_request,
    decode_request,
    error_body,
    translate,
    too_long,
)
from gateway.render.local import LocalRenderer
from gateway.apis.translate import Presented, turn
from tests.support.token_ids import id_list
from gateway.edge.validate import check_context, check_text_size

_encode = msgspec.json.Encoder().encode
CAPTURE_BILLING = "x-anthropic-billing-header: cc_version=2.1.197.fbe; cc_entrypoint=sdk-cli;"
"""Claude Code 2.1.197's first system block, as it sent it."""


DEFAULT_AGENTS = Agents()


def translated(agents: Agents = DEFAULT_AGENTS, **body: Any) -> Translated:
    return translate(decode_request(_encode({"model": "m", "max_tokens": 64, **body})).request, agents)


def refused(agents: Agents = DEFAULT_AGENTS, **body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        translated(agents, **body)
    return info.value


def wire(result: Translated) -> list[dict[str, Any]]:
    return msgspec.to_builtins(result.chat.messages)


# ------------------------------------------------------------ context_management


def think(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


THREE_TURNS: list[Any] = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": [think("first thought"), {"type": "text", "text": "a"}]},
    {"role": "user", "content": "two"},
    {"role": "assistant", "content": [think("second thought"), {"type": "text", "text": "b"}]},
    {"role": "user", "content": "three"},
    {"role": "assistant", "content": [think("third thought"), {"type": "text", "text": "c"}]},
    {"role": "user", "content": "four"},
]


def reasoning(result: Translated) -> list[str | None]:
    return [m.get("reasoning") for m in wire(result) if m["role"] == "assistant"]


@pytest.mark.parametrize(
    ("keep", "kept", "cleared"),
    [
        ("all", ["first thought", "second thought", "third thought"], 0),
        ({"type": "all"}, ["first thought", "second thought", "third thought"], 0),
        (None, [None, None, "third thought"], 2),  # Anthropic's default: the last turn's
        ({"type": "thinking_turns", "value": 2}, [None, "second thought", "third thought"], 1),
        ({"type": "thinking_turns", "value": 0}, [None, None, None], 3),
    ],
)
def test_clear_thinking_keeps_the_last_turns(keep: Any, kept: list[str | None], cleared: int) -> None:
    edit = {"type": "clear_thinking_20251015"} if keep is None else {"type": "clear_thinking_20251015", "keep": keep}
    result = translated(messages=THREE_TURNS, context_management={"edits": [edit]})
    assert reasoning(result) == kept
    applied = msgspec.to_builtins(result.applied)
    chars = sum(len(thought) for thought in ("first thought", "second thought", "third thought")[:cleared])  # 4 a token
    assert applied == {
        "applied_edits": [{"type": "clear_thinking_20251015", "cleared_input_tokens": -(-chars // 4), "cleared_thinking_turns": cleared}]
        if cleared else []
    }


def test_without_context_management_nothing_is_edited_or_reported() -> None:
    result = translated(messages=THREE_TURNS)
    assert reasoning(result) == ["first thought", "second thought", "third thought"] and result.applied is None


def tool_loop(n: int) -> list[Any]:
    """A conversation of `n` shell calls and their outputs."""
    messages: list[Any] = [{"role": "user", "content": "go"}]
    for i in range(n):
        name = "Read" if i == 1 else "Bash"
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": name, "input": {"command": f"cmd {i}"}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": f"output {i} " * 100}]})
    return messages


def results(result: Translated) -> list[str]:
    return [m["content"] for m in wire(result) if m["role"] == "tool"]


def inputs(result: Translated) -> list[str]:
    return [call["function"]["arguments"] for m in wire(result) if m["role"] == "assistant" for call in m["tool_calls"]]


def test_clear_tool_uses_clears_old_results_but_the_kept_and_excluded() -> None:
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 3},
        "keep": {"type": "tool_uses", "value": 2},
        "exclude_tools": ["Read"],
    }
    result = translated(messages=tool_loop(5), context_management={"edits": [edit]})
    outputs = results(result)
    assert outputs[0] == CLEARED and outputs[2] == CLEARED  # the oldest, not excluded
    assert outputs[1].startswith("output 1") and outputs[3].startswith("output 3") and outputs[4].startswith("output 4")
    assert inputs(result) == [json.dumps({"command": f"cmd {i}"}, separators=(",", ":")) for i in range(5)]
    applied = msgspec.to_builtins(result.applied)["applied_edits"]
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_input_tokens": 2 * 225, "cleared_tool_uses": 2}]


def test_clear_tool_uses_default_trigger_and_clear_inputs() -> None:
    default = translated(messages=tool_loop(5), context_management={"edits": [{"type": "clear_tool_uses_20250919"}]})
    assert CLEARED not in results(default) and msgspec.to_builtins(default.applied) == {"applied_edits": []}  # far under 100,000 tokens
    low = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000}, "clear_tool_inputs": ["Bash"]}
    result = translated(messages=tool_loop(5), context_management={"edits": [low]})
    assert results(result)[:2] == [CLEARED, CLEARED] and CLEARED not in results(result)[2:]  # the last 3 kept
    assert inputs(result)[:2] == ["{}", json.dumps({"command": "cmd 1"}, separators=(",", ":"))]  # only Bash's inputs


def test_clear_at_least_clears_nothing_unless_that_much_can_go() -> None:
    edit: dict[str, Any] = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 4}}
    enough = translated(messages=tool_loop(5), context_management={"edits": [{**edit, "clear_at_least": {"type": "input_tokens", "value": 225}}]})
    assert results(enough)[0] == CLEARED
    short = translated(messages=tool_loop(5), context_management={"edits": [{**edit, "clear_at_least": {"type": "input_tokens", "value": 226}}]})
    assert CLEARED not in results(short)


def test_unknown_edit_types_are_ignored_and_malformed_ones_named() -> None:
    result = translated(messages=THREE_TURNS, context_management={"edits": [{"type": "compact_20260112", "trigger": {}}, {"type": "clear_thinking_20251015", "keep": "all"}]})
    assert result.ignored_edits == ("compact_20260112",) and len(reasoning(result)) == 3
    cases = [
        ({"type": "clear_thinking_20251015", "keep": "some"}, "context_management.edits[0].keep"),
        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": -1}}, "context_management.edits[0].keep.value"),
        ({"type": "clear_tool_uses_20250919", "kep": {}}, "context_management.edits[0].kep"),
        ({"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens"}}, "context_management.edits[0].trigger.value"),
        ({"keep": "all"}, "context_management.edits[0].type"),
    ]
    for edit, param in cases:
        error = refused(messages=THREE_TURNS, context_management={"edits": [edit]})
        assert error.param == param and error.message.startswith(f"{param}: ") and error.status == 400
    assert refused(messages=THREE_TURNS, context_management={"edit": []}).param == "context_management.edit"


async def test_applied_edits_reach_the_answer() -> None:
    request = decode_request(_encode({"model": "m", "max_tokens": 64, "messages": THREE_TURNS, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]}})).request
    result = translate(request)
    meta = Presented(response_id="msg_1", model="m", created=0, prompt_tokens=3)
    answer = ChatCompletion(
        model="m", choices=[ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="ok"), finish_reason="stop")],
        usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4),
    )
    message = msgspec.to_builtins(await MessagesPresenter(result.applied).whole(turn(request, result.chat), meta, answer))
    assert message["context_management"]["applied_edits"][0]["cleared_thinking_turns"] == 2
    assert "context_management" not in msgspec.to_builtins(await MessagesPresenter(None).whole(turn(request, result.chat), meta, answer))
    assert isinstance(result.applied, ContextManagementResponse)


# ------------------------------------------------------------ Anthropic's typed tools


def tools_of(result: Translated) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in msgspec.to_builtins(result.chat.tools or [])}


def test_client_tools_become_function_tools_with_anthropics_schemas() -> None:
    result = translated(
        messages=[{"role": "user", "content": "hi"}],
        tools=[
            {"type": "bash_20250124", "name": "bash"},
            {"type": "text_editor_20250124", "name": "str_replace_editor"},
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10000},
            {"type": "memory_20250818", "name": "memory"},
        ],
    )
    tools = tools_of(result)
    assert list(tools) == ["bash", "str_replace_editor", "str_replace_based_edit_tool", "memory"]
    assert set(tools["bash"]["parameters"]["properties"]) == {"command", "restart"}
    assert tools["str_replace_editor"]["parameters"]["properties"]["command"]["enum"][-1] == "undo_edit"
    editor = tools["str_replace_based_edit_tool"]["parameters"]
    assert editor["properties"]["command"]["enum"] == ["view", "create", "str_replace", "insert"] and editor["required"] == ["command", "path"]
    assert {"old_path", "new_path", "insert_text"} <= set(tools["memory"]["parameters"]["properties"])
    assert all(tool["description"] for tool in tools.values())


def test_server_tools_are_dropped_or_refused_and_computer_use_refused() -> None:
    tools: list[Any] = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"name": "get_weather", "input_schema": {"type": "object"}},
        {"type": "code_execution_20250825", "name": "code_execution"},
        {"type": "brand_new_20270101", "name": "novel"},
    ]
    result = translated(messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert list(tools_of(result)) == ["get_weather"]
    assert result.dropped_tools == ("web_search", "code_execution", "_other")
    error = refused(Agents(hosted_tools="refuse"), messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert error.param == "tools[0].type" and "web_search_20250305" in error.message
    computer = {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768}
    error = refused(messages=[{"role": "user", "content": "hi"}], tools=[computer])
    assert error.param == "tools[0].type" and "screenshots" in error.message


# ------------------------------------------------------------ blocks, system, cache_control, fields


EPHEMERAL = {"type": "ephemeral"}


def test_cache_control_is_accepted_everywhere_and_changes_nothing() -> None:
    def body(cache: dict[str, Any] | None) -> dict[str, Any]:
        c = {"cache_control": cache} if cache else {}
        return {
            "system": [{"type": "text", "text": "sys", **c}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "go", **c}]},
                {"role": "assistant", "content": [{**think("hm"), **c}, {"type": "tool_use", "id": "t", "name": "f", "input": {}, **c}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r", **c}], **c}]},
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, **c}, {"type": "bash_20250124", "name": "bash", **c}],
            **c,
        }

    cached, plain = translated(**body(EPHEMERAL)), translated(**body(None))
    assert cached.chat == msgspec.structs.replace(plain.chat, request_id=cached.chat.request_id)


def test_mid_conversation_system_messages_render_where_they_are(qwen3_tokenizer_dir: Path) -> None:
    result = translated(
        system="You are terse.",
        messages=[
            {"role": "user", "content": "first"},
            {"role": "system", "content": "Agent types: claude, Explore."},
            {"role": "user", "content": "second"},
        ],
    )
    assert [m["role"] for m in wire(result)] == ["system", "user", "system", "user"]
    text = LocalRenderer(qwen3_tokenizer_dir).chat_text(result.chat)
    assert text.index("first") < text.index("<|im_start|>system\nAgent types: claude, Explore.<|im_end|>") < text.index("second")


def test_effort_and_adaptive_thinking_reach_the_template() -> None:
    result = translated(messages=[{"role": "user", "content": "hi"}], thinking={"type": "adaptive"}, output_config={"effort": "high"})
    assert result.chat.reasoning_effort == "high"
    assert result.chat.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}


def test_effort_reaches_a_template_that_reads_it() -> None:
    """gpt-oss's template writes `Reasoning: {{ reasoning_effort }}` into its system message."""
    template = ChatTemplate("Reasoning: {{ reasoning_effort | default('medium') }}{% for m in messages %}|{{ m.content }}{% endfor %}")
    chat = translated(messages=[{"role": "user", "content": "hi"}], output_config={"effort": "low"}).chat
    assert template.render(msgspec.to_builtins(chat.messages), kwargs=chat.chat_template_kwargs) == "Reasoning: low|hi"


def test_count_tokens_sees_the_prompt_a_message_would() -> None:
    body: dict[str, Any] = {
        **session(CAPTURE_BILLING),
        "model": "m",
        "tools": [{"type": "bash_20250124", "name": "bash"}, {"type": "web_search_20250305", "name": "web_search"}],
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    counted = count_tokens_to_chat(decode_count_tokens_request(_encode(body)).request)
    full = translated(**body).chat
    assert counted.messages == full.messages and counted.tools == full.tools and len(counted.tools or ()) == 1


def test_sampling_extras_pass_to_the_chat_request() -> None:
    extras: dict[str, Any] = {"ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7, "frequency_penalty": 0.2, "presence_penalty": 0.1,
              "min_tokens": 3, "stop_token_ids": [2], "skip_special_tokens": False}
    chat = translated(messages=[{"role": "user", "content": "hi"}], **extras).chat
    assert {name: getattr(chat, name) for name in extras} == extras
    plain = translated(messages=[{"role": "user", "content": "hi"}]).chat
    assert plain.ignore_eos is False and plain.seed is None


def test_claude_codes_metadata_and_first_request_decode() -> None:
    user_id = json.dumps({"device_id": "410c", "account_uuid": "", "session_id": "03c2ffd2-4945-4775-9adb-a43b5facfe0f"})
    result = translated(messages=[{"role": "user", "content": "hi"}], metadata={"user_id": user_id})
    assert wire(result)[-1] == {"role": "user", "content": "hi"}


# ------------------------------------------------------------ the attribution line


def session(billing: str) -> dict[str, Any]:
    return {
        "system": [
            {"type": "text", "text": billing},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "You are an interactive agent that helps users with software engineering tasks. " * 20},
        ],
        "messages": [{"role": "user", "content": "Run the shell command: echo hello"}],
    }


def test_the_attribution_line_is_stripped() -> None:
    stripped = wire(translated(**session(CAPTURE_BILLING)))[0]["content"]
    assert stripped.startswith("You are a Claude agent") and "billing" not in stripped
    kept = wire(translated(Agents(strip_attribution=False), **session(CAPTURE_BILLING)))[0]["content"]
    assert kept.startswith(CAPTURE_BILLING)
    shared = translated(system=f"{CAPTURE_BILLING}\nBe brief.", messages=[{"role": "user", "content": "hi"}])
    assert wire(shared)[0]["content"] == "Be brief."  # a block that holds more loses only the line
    later = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": CAPTURE_BILLING}]
    assert wire(translated(system=later, messages=[{"role": "user", "content": "hi"}]))[0]["content"] == "Be brief."


def test_stripping_lets_two_sessions_share_the_whole_system_prompt(qwen3_tokenizer_dir: Path) -> None:
    """Two conversations of one release differ in the line's `cch=`; of two releases, in
    `cc_version=` too. With the line stripped, their prompts share every system-prompt token."""
    renderer = LocalRenderer(qwen3_tokenizer_dir)
    one = session("x-anthropic-billing-header: cc_version=2.1.197.fbe; cc_entrypoint=sdk-cli; cch=1f3a9;")
    two = session("x-anthropic-billing-header: cc_version=2.1.198.a07; cc_entrypoint=sdk-cli; cch=77c02;")

    def prompts(agents: Agents) -> tuple[list[int], list[int]]:
        return id_list(renderer.chat_sync(translated(agents, **one).chat)), id_list(renderer.chat_sync(translated(agents, **two).chat))

    def shared(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    with_strip = prompts(Agents())
    without = prompts(Agents(strip_attribution=False))
    system = id_list(renderer.chat_sync(msgspec.structs.replace(translated(**one).chat, messages=translated(**one).chat.messages[:1], add_generation_prompt=False)))
    print(f"shared prefix tokens: stripped {shared(*with_strip)} of {len(with_strip[0])}; "
          f"kept {shared(*without)} of {len(without[0])}; system prompt {len(system)}")
    assert with_strip[0] == with_strip[1]  # the same rest: the whole prompt is shared
    assert shared(*with_strip) >= len(system)
    line = id_list(renderer.encode_sync("<|im_start|>system\nx-anthropic-billing-header: cc_version=2.1.19"))
    assert shared(*without) <= len(line)  # only the tokens before the line differs


# ------------------------------------------------------------ a prompt over the context


def overflow_message(check: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        check()
    return msgspec.json.decode(error_body(info.value))["error"]["message"]


def test_context_overflow_in_anthropics_words() -> None:
    assert overflow_message(lambda: check_context([[1] * 120], 100)) == "prompt is too long: 120 tokens > 100 maximum"
    assert overflow_message(lambda: check_text_size(1000, 100, 4)) == "prompt is too long: 250 tokens > 100 maximum"
    vllm = ("This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. "
            "Please reduce the length of the input messages.")
    assert too_long(vllm) == "prompt is too long: 5000 tokens > 4096 maximum"
    body = msgspec.json.decode(error_body(InvalidRequest("max_tokens: Field required")))
    assert body["error"]["message"] == "max_tokens: Field required"  # others unchanged
