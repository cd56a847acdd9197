"""Names onehop lacks, parsed by vLLM in-process on the `vllm` backend (opt-in: needs vLLM's venv).

Two halves, both on the tiny Qwen3 model and its tokenizer:

- `run_vllm_parsers.py` (vLLM's venv, no model run): hand-made Hermes outputs
  through `ChatDerender` with onehop's qwen3 + vLLM's `qwen3_json` (its hermes
  alias, which onehop does not register), and with vLLM's own qwen3 + hermes as
  one parser, give onehop's native qwen3 + hermes answer in every chunking and
  non-streamed; `resolve_parsers` on the vllm backend accepts vLLM's names and
  refuses names neither side knows, listing both sides' names;
- a onehop engine over the vllm backend started with `--tool-parser qwen3_json
  --reasoning-parser qwen3`: capabilities say who parses each name, and
  derender-mode chat with tools answers in OpenAI shape, streamed and not (the
  random model rarely calls a tool; the first half covers the calls).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wire.openai_schema import CHAT_COMPLETION_CHUNK_DECODER, CHAT_COMPLETION_DECODER
from tests.support.ports import free_port
from tests.vllm.conftest import ROOT, has_done, post, server_env, sse_payloads, start_server, stop_server, wait_ready
from tests.vllm.run_vllm_parsers import CASES, MESSAGES, REQUESTS, TOOLS

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("run_vllm_parsers.py")
# vLLM's import (~15-45 s on two busy cores) plus a few hundred parser calls.
SCRIPT_TIMEOUT_S = 300
MAX_MODEL_LEN = 2048
MAX_TOKENS = 24
GENERATE = "/inference/v1/generate"
WAYS = ("mixed", "whole")
# conftest's 240 s is short when the two shared cores are busy: vLLM's import alone took minutes.
ENGINE_READY_TIMEOUT_S = 480.0
# Thinking off: the output is content from the first token, so vLLM's tool stage parses all of it.
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def report(vllm_python: Path, tiny_model_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(vllm_python), str(SCRIPT), str(tiny_model_dir)],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        pytest.fail(f"run_vllm_parsers.py exited {done.returncode}:\n{out[-4000:]}\n{done.stderr.decode()[-6000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def engine_url(vllm_python: Path, tiny_model_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        str(vllm_python), "-m", "onehop", "engine", "--backend", "vllm", "--model", str(tiny_model_dir),
        "--tool-parser", "qwen3_json", "--reasoning-parser", "qwen3",
        "--port", str(port), "--backend-option", f"max_model_len={MAX_MODEL_LEN}",
    ]  # fmt: skip
    server = start_server("onehop engine (vllm backend, qwen3_json)", argv, port, server_env())
    try:
        wait_ready(server, ENGINE_READY_TIMEOUT_S)
        yield server.url
    finally:
        stop_server(server)


# ------------------------------------------------------------ vLLM's parsers inside onehop's derender


def test_vllm_names_are_accepted_and_unknown_ones_refused_with_both_lists(report: dict[str, Any]) -> None:
    start = report["start"]
    assert start["accepted"] == ["qwen3", "qwen3_json"]
    reasoning, tool = start["refusals"]["reasoning_parser"], start["refusals"]["tool_parser"]
    assert "'no_such_parser'" in reasoning and "qwen3" in reasoning and "minimax_m2" in reasoning
    assert "'no_such_parser'" in tool and "hermes" in tool and "qwen3_json" in tool


def test_mixed_set_keeps_onehop_reasoning_and_the_tool_markers(report: dict[str, Any]) -> None:
    assert report["mixed_set"] == {
        "type": "ParserSet",
        "marker_ids": {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658},
    }


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    "case", [*CASES, *(f"{name}/{field}" for name, fields in REQUESTS.items() for field in fields)]
)
def test_vllm_parsed_answer_is_onehops_native_answer(report: dict[str, Any], case: str, way: str) -> None:
    native, theirs = report["cases"][case]["native"], report["cases"][case][way]
    for label, answer in theirs.items():
        assert {k: v for k, v in answer.items() if k != "ids"} == {k: v for k, v in native[label].items() if k != "ids"}, label
        assert all(call_id.startswith("chatcmpl-tool-") for call_id in answer["ids"])
        assert len(set(answer["ids"])) == len(answer["ids"])
        assert answer["full"] == {k: answer[k] for k in ("reasoning", "content", "calls")}, label


def test_cases_call_tools_and_single_call_mode_keeps_one(report: dict[str, Any]) -> None:
    assert len(report["cases"]["text_then_two_calls"]["native"]["stream-1"]["calls"]) == 2
    assert len(report["cases"]["text_then_two_calls/parallel_tool_calls"]["mixed"]["stream-1"]["calls"]) == 1


# ------------------------------------------------------------ a running engine


def test_capabilities_say_who_parses(engine_url: str) -> None:
    with urllib.request.urlopen(engine_url + "/inference/v1/capabilities") as response:
        capabilities = json.loads(response.read())
    assert capabilities["backend"] == "vllm"
    assert (capabilities["reasoning_parser"], capabilities["tool_parser"]) == ("qwen3", "qwen3_json")
    assert capabilities["parsers"] == {"qwen3": "onehop", "qwen3_json": "vllm"}
    assert "derender" in capabilities["output_modes"]


def derender_body(prompt: list[int], *, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "request_id": f"fallback-{'stream' if stream else 'full'}",
        "token_ids": prompt,
        "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS},
        "output_mode": "derender",
        "stream": stream,
        "chat_request": {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": TOOLS,
            "stream": stream,
            "chat_template_kwargs": NO_THINKING,
        },
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def tool_prompt(qwen3_tokenizer: Any) -> list[int]:
    text = qwen3_tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True, **NO_THINKING
    )
    return list(qwen3_tokenizer.encode(text, add_special_tokens=False))


def test_derender_chat_with_tools_non_streamed(engine_url: str, tool_prompt: list[int]) -> None:
    status, body = post(engine_url + GENERATE, derender_body(tool_prompt, stream=False))
    assert status == 200, body[:500]
    completion = CHAT_COMPLETION_DECODER.decode(body)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    (choice,) = completion.choices
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert choice.message.role == "assistant" and choice.message.reasoning is None
    assert choice.message.content or choice.message.tool_calls
    usage = completion.usage
    assert usage is not None and usage.completion_tokens is not None and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.completion_tokens_details is not None and usage.completion_tokens_details.reasoning_tokens == 0


def test_derender_chat_with_tools_streamed(engine_url: str, tool_prompt: list[int]) -> None:
    status, body = post(engine_url + GENERATE, derender_body(tool_prompt, stream=True))
    assert status == 200, body[:500]
    assert has_done(body) and b'"error"' not in body
    chunks = [CHAT_COMPLETION_CHUNK_DECODER.decode(payload) for payload in sse_payloads(body)]
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] in ("length", "stop", "tool_calls")
    deltas = [c.delta for chunk in chunks[1:] for c in chunk.choices]
    assert any(d.content or d.tool_calls for d in deltas) and not any(d.reasoning for d in deltas)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
