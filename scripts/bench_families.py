"""CPU per output token of each parser family: onehop's stateful derender vs vLLM's same parser.

The family axis of `scripts/bench_derender.py`. For every delivered family the
same token stream (a reasoning block, then two tool calls, written with the
family's own writers and cut to each length; a family without reasoning writes
the padding into the first call's `city` argument instead) is fed one token
per chunk:

    onehop: `ChatDerender.step` per token (detokenize + stop strings + parse +
            chunk object), thread CPU around the per-token loop;
    vLLM:   0.32's `IncrementalDetokenizer` + `parse_delta` of the parser of
            the same name per token (`scripts/vllm_parser_cost.py`, run by the
            vLLM venv's python), the same way.

Test tokenizers are the offline family fixtures (the Qwen3 BPE plus the
family's marker tokens; gpt-oss's own o200k vocabulary for Harmony).

    .venv/bin/python scripts/bench_families.py [--lengths 512,1024,2048,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402

from derender.chat import ChatDerender, ChatOptions  # noqa: E402
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS  # noqa: E402
from derender.parsers.base import ToolCallText  # noqa: E402
from derender.vocab import vocab_for  # noqa: E402
from wire.openai_schema import ChatCompletionRequest  # noqa: E402
from engine.qwen3.fixtures import cache_dir, ensure_tokenizer  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]
CALLS = [ToolCallText("get_weather", {"city": "Paris", "days": 3}), ToolCallText("get_time", {"tz": "Europe/Paris"})]
WORDS = [
    "the", "user", "asks", "about", "weather", "so", "consider", "which", "city", "they", "mean", "天气", "巴黎", "🌦",
    "café", "naïve", "42", "3.14", "(x", "+", "y)",
]
SLOT = "\x00"


@dataclass(frozen=True)
class Family:
    label: str
    reasoning: str | None
    tool: str
    tokenizer: Callable[[str | None], Path]
    model_type: str | None = None


def _qwen3(_: str | None) -> Path:
    return ensure_tokenizer()


def _added(name: str, added: list[tuple[str, bool]], eos: str | None = None) -> Callable[[str | None], Path]:
    def build(_: str | None) -> Path:
        from tests.support.family_tokenizers import build_family_tokenizer

        return build_family_tokenizer(cache_dir(), f"bench-{name}", added, eos=eos)

    return build


def _harmony(vllm_python: str | None) -> Path:
    from tests.support.harmony_tokenizer import harmony_tokenizer, o200k_harmony_tokenizer

    return o200k_harmony_tokenizer(vllm_python) if vllm_python else harmony_tokenizer()


def _beside_qwen3(build: Callable[[Path], Path]) -> Callable[[str | None], Path]:
    """A family fixture folder built next to the Qwen3 one (the tests' own builders)."""
    return lambda _: build(ensure_tokenizer())


def families() -> list[Family]:
    from tests.support import deepseek, glm_tokenizer, harmony_tokenizer, kimi_k2, llama3, minimax_m2, mistral

    out = [
        Family("qwen3 + hermes", "qwen3", "hermes", _qwen3),
        Family("qwen3 + qwen3_coder", "qwen3", "qwen3_coder", _qwen3),
        Family("glm45 + glm47", "glm45", "glm47", _added("glm", list(glm_tokenizer.ADDED))),
        Family("kimi_k2", "kimi_k2", "kimi_k2", _added("kimi", [(t, True) for t in kimi_k2.SPECIALS]), "kimi_k2"),
        Family("openai_gptoss + openai", "openai_gptoss", "openai", _harmony, "gpt_oss"),
    ]
    del harmony_tokenizer
    out += [
        Family("deepseek_r1 + deepseek_v3", "deepseek_r1", "deepseek_v3", _added("deepseek", list(deepseek.ADDED))),
        Family("minimax_m2", "minimax_m2", "minimax_m2", _beside_qwen3(minimax_m2.minimax_tokenizer_dir)),
        Family("mistral", "mistral", "mistral", _beside_qwen3(mistral.mistral_tokenizer_dir)),
        Family("llama3_json", None, "llama3_json", _beside_qwen3(llama3.llama3_tokenizer_dir), "llama"),
        Family("pythonic", None, "pythonic", _qwen3),
    ]
    return out


def stream_ids(family: Family, tokenizer: Any, length: int) -> list[int]:
    """About `length` output ids: the family's reasoning block padded with words, its two calls, EOS."""
    write_calls = TOOL_PARSERS[family.tool].format_calls
    assert write_calls is not None
    rng = random.Random(0)
    words = [rng.choice(WORDS) for _ in range(length * 2)]
    eos = [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)] if tokenizer.eos_token else []
    if family.reasoning is None:
        return _padded_call(write_calls, tokenizer, words, length) + eos
    write_reasoning = REASONING_PARSERS[family.reasoning].format_reasoning
    assert write_reasoning is not None
    opening, _, closing = write_reasoning(SLOT).partition(SLOT)
    head = tokenizer.encode(opening + " ".join(words), add_special_tokens=False)
    tail = tokenizer.encode(closing + write_calls(CALLS), add_special_tokens=False) + eos
    return head[: max(0, length - len(tail))] + tail


def _padded_call(write_calls: Callable[..., str], tokenizer: Any, words: list[str], length: int) -> list[int]:
    """The two calls with the first one's `city` grown by words until the text is `length` tokens."""

    def encoded(n: int) -> list[int]:
        first = ToolCallText(CALLS[0].name, {**CALLS[0].arguments, "city": " ".join(words[:n])})
        return tokenizer.encode(write_calls([first, *CALLS[1:]]), add_special_tokens=False)

    low, high = 0, len(words)
    while low < high:  # the most words that still fit
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(encoded(middle)) <= length else (low, middle - 1)
    return encoded(low)


def onehop_cost(family: Family, vocab: Any, ids: list[int], repeats: int) -> float:
    request = msgspec.convert({"model": "bench", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, ChatCompletionRequest)
    options = ChatOptions.from_request(request, reasoning_parser=family.reasoning, tool_parser=family.tool)
    best = float("inf")
    for _ in range(repeats):
        derender = ChatDerender(vocab, options, model="bench")
        last = len(ids) - 1
        gc.collect()
        start = time.thread_time()
        for i, token_id in enumerate(ids):  # one token per chunk
            derender.step(0, (token_id,), finish_reason="stop" if i == last else None)
        best = min(best, time.thread_time() - start)
    return best


def vllm_costs(python: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(cases, handle)
    try:
        done = subprocess.run(
            [python, str(ROOT / "scripts" / "vllm_parser_cost.py"), handle.name],
            capture_output=True, text=True, timeout=3600, check=False,
        )
    finally:
        os.unlink(handle.name)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM cost run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def measure(lengths: list[int], vllm_python: str | None, repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    rows: list[dict[str, Any]] = []
    cases: list[dict[str, Any]] = []
    for family in families():
        folder = family.tokenizer(vllm_python)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        vocab = vocab_for(tokenizer)
        for length in lengths:
            ids = stream_ids(family, tokenizer, length)
            ours = onehop_cost(family, vocab, ids, repeats)
            rows.append({"family": family.label, "tokens": len(ids), "onehop_us": ours / len(ids) * 1e6})
            cases.append({
                "tokenizer": str(folder), "tool_parser": family.tool, "reasoning_parser": family.reasoning,
                "tools": TOOLS, "prompt_token_ids": [], "output_token_ids": ids, "repeats": repeats,
                "model_type": family.model_type,
            })
            print(f"onehop {family.label} {len(ids)} tokens: {rows[-1]['onehop_us']:.2f} µs/token", file=sys.stderr)
    if vllm_python:
        for row, result in zip(rows, vllm_costs(vllm_python, cases), strict=True):
            row["vllm_us"] = result["cpu_s"] / max(1, result["tokens"]) * 1e6
            row["ratio"] = row["onehop_us"] / row["vllm_us"]
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "CPU per output token, one token per chunk (µs; best of runs)",
        "",
        "| family | tokens | onehop | vLLM 0.32 same parser | onehop / vLLM |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        vllm = f"{row['vllm_us']:.2f}" if "vllm_us" in row else "n/a"
        ratio = f"{row['ratio']:.3f}×" if "ratio" in row else "n/a"
        lines.append(f"| {row['family']} | {row['tokens']} | {row['onehop_us']:.2f} | {vllm} | {ratio} |")
    by_family: dict[str, list[float]] = {}
    for row in rows:
        by_family.setdefault(row["family"], []).append(row["onehop_us"])
    lines.append("")
    for label, costs in by_family.items():
        growth = costs[-1] / costs[0] if costs[0] else float("nan")
        worst = max((r["ratio"] for r in rows if r["family"] == label and "ratio" in r), default=float("nan"))
        lines.append(f"{label}: per-token growth {growth:.2f}× over the lengths (flat ≤ 1.5×); worst onehop/vLLM {worst:.3f}× (target ≤ 0.5×)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=os.environ.get("ONEHOP_VLLM_PYTHON"))
    parser.add_argument("--no-vllm", action="store_true", help="onehop's column only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    python = None if args.no_vllm else args.vllm_python
    if python is None and not args.no_vllm:
        default = Path.home() / ".cache" / "onehop" / "vllm-venv" / "bin" / "python"
        python = str(default) if default.exists() else None
    rows = measure([int(x) for x in args.lengths.split(",")], python, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
