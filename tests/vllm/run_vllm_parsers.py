"""onehop's derender over vLLM's in-process parsers vs its native ones; print one JSON report.

    <vllm-venv>/bin/python tests/vllm/run_vllm_parsers.py MODEL_DIR

Run in vLLM's venv by `tests/vllm/test_vllm_parser_fallback.py`. Hand-made
Hermes outputs (encoded with the model's tokenizer, then EOS) go through
`ChatDerender` three ways, streamed in chunks of 1 and 3 tokens and in one step
(the non-streaming answer):

- `native`: onehop's qwen3 + hermes;
- `mixed`: onehop's qwen3 + vLLM's `qwen3_json` (its hermes alias, which onehop
  lacks), bound by `bind_vllm_parsers` as the vllm backend binds it;
- `whole`: vLLM's own qwen3 + hermes as one parser (`VLLMParserSet`), the path
  for a reasoning name onehop lacks.

No model runs here: only vLLM's tokenizer and parsers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CHUNKINGS = {"stream-1": 1, "stream-3": 3}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


CASES = {
    "content_then_call": f"<think>\nCheck first.\n</think>\n\nLet me look that up.\n{call('get_weather', {'city': 'Paris', 'days': 2})}",
    "call_right_after_reasoning": f"<think>\nJust call it.\n</think>{call('get_time', {})}",
    "text_then_two_calls": (
        f"<think>\nTwo cities, two calls.\n</think>\n\nChecking both.\n"
        f"{call('get_weather', {'city': 'Zürich'})}\n{call('get_weather', {'city': 'Rome'})}"
    ),
    "no_call": "<think>\nNothing to call.\n</think>\n\nIt is sunny, I think.",
}


# Case name → extra chat request fields (`parallel_tool_calls: false` keeps the first call only).
REQUESTS: dict[str, dict[str, Any]] = {"text_then_two_calls": {"parallel_tool_calls": False}}


def chat_request(**extra: Any) -> Any:
    from wire.openai_schema import CHAT_COMPLETION_REQUEST_DECODER

    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True, **extra}
    return CHAT_COMPLETION_REQUEST_DECODER.decode(json.dumps(body))


def answer(
    vocab: Any, names: tuple[str, str], prompt: list[int], output: list[int], size: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """One pass of `output` through `ChatDerender` in steps of `size` tokens, folded."""
    import msgspec

    from derender.chat import ChatDerender, ChatOptions

    reasoning, tool = names
    options = ChatOptions.from_request(chat_request(**extra), reasoning_parser=reasoning, tool_parser=tool)
    derender = ChatDerender(vocab, options, model="m", prompt_token_ids=prompt, include_usage=True)
    folded: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for start in range(0, len(output), size):
        last = start + size >= len(output)
        chunk = derender.step(0, output[start : start + size], finish_reason="stop" if last else None)
        if chunk is not None:
            _fold(folded, msgspec.to_builtins(chunk.choices[0]))
    message = msgspec.to_builtins(derender.response().choices[0].message)
    calls = [folded["calls"][i] for i in sorted(folded["calls"])]
    return {
        "reasoning": folded["reasoning"] or None,
        "content": folded["content"] or None,
        "calls": [(c["name"], json.loads(c["arguments"])) for c in calls],
        "ids": [c["id"] for c in calls],
        "finish_reason": folded["finish_reason"],
        "reasoning_tokens": msgspec.to_builtins(derender.usage()).get("completion_tokens_details"),
        "full": {
            "reasoning": message.get("reasoning"),
            "content": message.get("content"),
            "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []],
        },
    }


def _fold(folded: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta") or {}
    folded["reasoning"] += delta.get("reasoning") or ""
    folded["content"] += delta.get("content") or ""
    for entry in delta.get("tool_calls") or []:
        slot = folded["calls"].setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
        function = entry.get("function") or {}
        slot["id"] = slot["id"] or entry.get("id")
        slot["name"] = slot["name"] or function.get("name")
        slot["arguments"] += function.get("arguments") or ""
    folded["finish_reason"] = choice.get("finish_reason") or folded["finish_reason"]


def start_checks(model_dir: str) -> dict[str, Any]:
    """What `resolve_parsers` accepts and refuses on the vllm backend."""
    from engine.app import resolve_parsers
    from engine.config import EngineConfig
    from derender.parsers import UnknownParser

    accepted, _ = resolve_parsers(
        EngineConfig(backend="vllm", model=model_dir, reasoning_parser="qwen3", tool_parser="qwen3_json")
    )
    refusals: dict[str, str] = {}
    unknown = {
        "reasoning_parser": EngineConfig(backend="vllm", model=model_dir, reasoning_parser="no_such_parser"),
        "tool_parser": EngineConfig(backend="vllm", model=model_dir, tool_parser="no_such_parser"),
    }
    for field, config in unknown.items():
        try:
            resolve_parsers(config)
        except UnknownParser as exc:
            refusals[field] = str(exc)
    return {"accepted": [accepted.reasoning_parser, accepted.tool_parser], "refusals": refusals}


def marker_ids(parser_set: object) -> dict[str, int]:
    """A bound parser set's marker ids (onehop's `ParserSet` or vLLM's), empty for anything else."""
    from engine.backends.vllm_parsers import VLLMParserSet
    from derender.parsers.choice import ParserSet

    return dict(parser_set.marker_ids) if isinstance(parser_set, ParserSet | VLLMParserSet) else {}


def main(model_dir: str) -> dict[str, Any]:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    from engine.backends.vllm_parsers import VLLMParserSet, bind_vllm_parsers
    from derender.vocab import vocab_for
    from engine.qwen3.vocab import IM_END_ID

    vllm_tokenizer = get_tokenizer(model_dir)
    fast = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    template = AutoTokenizer.from_pretrained(model_dir)
    # list(): a new list takes the element type transformers declares (dicts or callables).
    prompt_text = template.apply_chat_template(MESSAGES, tools=list(TOOLS), add_generation_prompt=True, tokenize=False)
    prompt = fast.encode(prompt_text, add_special_tokens=False).ids

    vocabs = {name: vocab_for(fast) for name in ("native", "mixed", "whole")}
    bind_vllm_parsers(vocabs["mixed"], vllm_tokenizer, "qwen3", "qwen3_json")
    vocabs["whole"].parsers[("qwen3", "hermes")] = VLLMParserSet(vllm_tokenizer, "qwen3", "hermes")
    names = {"native": ("qwen3", "hermes"), "mixed": ("qwen3", "qwen3_json"), "whole": ("qwen3", "hermes")}
    mixed_set = vocabs["mixed"].parsers[("qwen3", "qwen3_json")]

    report: dict[str, Any] = {
        "start": start_checks(model_dir),
        "mixed_set": {"type": type(mixed_set).__name__, "marker_ids": marker_ids(mixed_set)},
        "cases": {},
    }
    for case, text in CASES.items():
        output = [*fast.encode(text, add_special_tokens=False).ids, IM_END_ID]
        sizes = {**CHUNKINGS, "one-step": len(output)}
        for request_name, extra in (("", {}), *((f"/{k}", {k: v}) for k, v in REQUESTS.get(case, {}).items())):
            report["cases"][case + request_name] = {
                way: {label: answer(vocabs[way], names[way], prompt, output, size, extra) for label, size in sizes.items()}
                for way in vocabs
            }
    return report


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result = main(sys.argv[1])
    print(json.dumps(result, ensure_ascii=False), flush=True)
