"""CPU per output token of streaming chat derender, three ways, in one run.

    (a) onehop: one stateful ChatDerender per request, fed one token per chunk;
    (b) the stateless per-chunk shape of vLLM's streaming derender: every chunk
        builds a fresh derender and replays all earlier chunks through it
        before handling the new one (parser state cannot be carried, so it is
        rebuilt; the JSON transport of the growing state is NOT counted, so
        (b) is a lower bound of that design's cost);
    (c) vLLM 0.32's own in-process path (detokenizer + qwen3 reasoning +
        hermes tool parser, as its coupled server streams), run by
        `scripts/vllm_inprocess_parse.py` in vLLM's venv when one is found
        (`scripts/setup_vllm.sh` makes it; `--vllm-python` or
        `$ONEHOP_VLLM_PYTHON` point at it).

The workload is a reasoning output with two tool calls after it, cut to each
length. Two tiers are reported where both sides have them: `parse` (derender
up to the chunk object) and `serialize` (plus JSON encoding and SSE framing).

    .venv/bin/python scripts/bench_derender.py [--lengths 512,1024,2048,4096] [--json out.json]
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
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402

from derender.chat import ChatDerender, ChatOptions  # noqa: E402
from derender.vocab import TokenVocab, vocab_for  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from engine.qwen3.vocab import IM_END_ID  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone.",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]
TAIL = (
    "\n</think>\n\nLet me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
WORDS = [
    "the", "user", "asks", "about", "weather", "so", "first", "consider", "which", "city", "they", "mean", "and",
    "whether", "the", "unit", "matters", "then", "check", "the", "time", "zone", "because", "Paris", "uses",
    "central", "european", "time", "and", "daylight", "saving", "shifts", "it", "一", "二", "三", "天气", "时间", "巴黎",
    "🌦", "☀️", "🫠", "café", "naïve", "résumé", "42", "3.14", "(x", "+", "y)", "*", "z", "=", "w;", "if", "a", ">",
    "b:", "return", "c",
]
SSE_PREFIX = b"data: "
SSE_SUFFIX = b"\n\n"
OPTIONS = ChatOptions(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True)


@dataclass(frozen=True)
class Workload:
    prompt_ids: list[int]
    output_ids: list[int]


def build_workloads(tokenizer: Any, lengths: list[int]) -> dict[int, Workload]:
    """One output per length: `<think>` + varied reasoning + two tool calls + EOS."""
    messages = [{"role": "user", "content": "What's the weather and time in Paris?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt["input_ids"])
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(max(lengths) * 2))
    reasoning = tokenizer.encode("<think>\n" + words)
    tail = [*tokenizer.encode(TAIL), IM_END_ID]
    out: dict[int, Workload] = {}
    for length in lengths:
        body = reasoning[: length - len(tail)]
        out[length] = Workload(prompt_ids=prompt_ids, output_ids=body + tail)
    return out


def _derender(vocab: TokenVocab, prompt_ids: list[int]) -> ChatDerender:
    return ChatDerender(vocab, OPTIONS, model="bench", prompt_token_ids=prompt_ids)


def run_stateful(vocab: TokenVocab, work: Workload, *, serialize: bool) -> tuple[float, list[Any]]:
    """(a): CPU seconds for the whole stream and the chunks it produced."""
    encode = msgspec.json.Encoder().encode
    ids = work.output_ids
    last = len(ids) - 1
    chunks: list[Any] = []
    start = time.thread_time()
    derender = _derender(vocab, work.prompt_ids)
    for i, token_id in enumerate(ids):  # one token per chunk
        chunk = derender.step(0, (token_id,), finish_reason="stop" if i == last else None)
        if chunk is not None:
            if serialize:
                chunks.append(SSE_PREFIX + encode(chunk) + SSE_SUFFIX)
            else:
                chunks.append(chunk)
    return time.thread_time() - start, chunks


def run_stateless(vocab: TokenVocab, work: Workload, *, serialize: bool) -> tuple[float, list[Any]]:
    """(b): a fresh derender per chunk that replays every earlier chunk first."""
    encode = msgspec.json.Encoder().encode
    ids = work.output_ids
    last = len(ids) - 1
    chunks: list[Any] = []
    start = time.thread_time()
    for i, token_id in enumerate(ids):
        derender = _derender(vocab, work.prompt_ids)
        for earlier in ids[:i]:  # replay: parser state cannot travel between calls
            derender.step(0, (earlier,))
        chunk = derender.step(0, (token_id,), finish_reason="stop" if i == last else None)
        if chunk is not None:
            chunks.append(SSE_PREFIX + encode(chunk) + SSE_SUFFIX if serialize else chunk)
    return time.thread_time() - start, chunks


def best_of(repeats: int, fn: Callable[[], tuple[float, list[Any]]]) -> tuple[float, list[Any]]:
    best: tuple[float, list[Any]] | None = None
    for _ in range(repeats):
        gc.collect()
        result = fn()
        if best is None or result[0] < best[0]:
            best = result
    assert best is not None
    return best


def default_vllm_python() -> Path | None:
    configured = os.environ.get("ONEHOP_VLLM_PYTHON")
    if configured:
        return Path(configured) if Path(configured).exists() else None
    venv = Path(os.environ.get("ONEHOP_VLLM_VENV", Path.home() / ".cache" / "onehop" / "vllm-venv"))
    candidate = venv / "bin" / "python"
    return candidate if candidate.exists() else None


def run_vllm(python: Path, tokenizer_dir: Path, work: Workload, repeats: int) -> dict[str, Any]:
    """(c): vLLM's own in-process path in its own interpreter; returns its JSON report."""
    spec = {
        "tokenizer": str(tokenizer_dir),
        "prompt_token_ids": work.prompt_ids,
        "output_token_ids": work.output_ids,
        "tools": TOOLS,
        "enable_thinking": True,
        "repeats": repeats,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        done = subprocess.run(
            [str(python), str(ROOT / "scripts" / "vllm_inprocess_parse.py"), handle.name],
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
    finally:
        os.unlink(handle.name)
    return json.loads(done.stdout)


def fold(chunks: list[Any]) -> dict[str, Any]:
    """Joined reasoning/content/tool calls, to check (a) and (b) agree."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        body = msgspec.json.decode(chunk[len(SSE_PREFIX) : -len(SSE_SUFFIX)]) if isinstance(chunk, bytes) else msgspec.to_builtins(chunk)
        for choice in body["choices"]:
            delta = choice["delta"]
            reasoning.append(delta.get("reasoning") or "")
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return {"reasoning": "".join(reasoning), "content": "".join(content), "tool_calls": list(calls.values())}


def measure(lengths: list[int], vllm_python: Path | None, repeats: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer_dir = ensure_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = vocab_for(tokenizer)
    workloads = build_workloads(tokenizer, lengths)
    rows = []
    for work in workloads.values():
        n = len(work.output_ids)
        a_parse, _ = best_of(repeats, partial(run_stateful, vocab, work, serialize=False))
        a_ser, a_chunks = best_of(repeats, partial(run_stateful, vocab, work, serialize=True))
        b_repeats = 1 if n >= 2048 else repeats
        b_ser, b_chunks = best_of(b_repeats, partial(run_stateless, vocab, work, serialize=True))
        assert fold(a_chunks) == fold(b_chunks), "stateless replay must produce the same answer"
        row: dict[str, Any] = {
            "tokens": n,
            "a_parse_us": a_parse / n * 1e6,
            "a_serialize_us": a_ser / n * 1e6,
            "b_serialize_us": b_ser / n * 1e6,
            "result": fold(a_chunks),
        }
        if vllm_python is not None:
            report = run_vllm(vllm_python, tokenizer_dir, work, repeats)
            row["c_parse_us"] = report["cpu_s"]["detok_parse"] / n * 1e6
            row["c_serialize_us"] = report["cpu_s"]["detok_parse_serialize"] / n * 1e6
            row["vllm_version"] = report.get("vllm_version")
            row["vllm_result"] = report.get("result")
        rows.append(row)
        print(f"measured {n} tokens", file=sys.stderr)
    return {"rows": rows, "vllm": vllm_python is not None}


def same_answer(ours: dict[str, Any], vllm: dict[str, Any]) -> bool:
    calls = [(c["name"], c["arguments"]) for c in ours["tool_calls"]]
    content = vllm["content"] or ""
    if vllm["tool_calls"]:
        # A named difference: onehop drops the whitespace right before a call, which vLLM
        # streams as content (docs/derender.md, "Behaviour").
        content = content.rstrip()
    return (
        ours["reasoning"] == vllm["reasoning"]
        and ours["content"] == content
        and calls == [(c["name"], c["arguments"]) for c in vllm["tool_calls"]]
    )


def report(results: dict[str, Any]) -> str:
    rows = results["rows"]
    has_c = results["vllm"]
    head = "| tokens | (a) onehop parse | (a) + serialize | (b) stateless replay + serialize |"
    rule = "|---:|---:|---:|---:|"
    if has_c:
        head += " (c) vLLM parse | (c) + serialize |"
        rule += "---:|---:|"
    head += " (b)/(a) |" + (" (c)/(a) parse | (c)/(a) serialize |" if has_c else "")
    rule += "---:|" + ("---:|---:|" if has_c else "")
    lines = ["CPU per output token, one token per chunk (µs; best of runs)", "", head, rule]
    for row in rows:
        cells = [str(row["tokens"]), f"{row['a_parse_us']:.2f}", f"{row['a_serialize_us']:.2f}", f"{row['b_serialize_us']:.1f}"]
        if has_c:
            cells += [f"{row['c_parse_us']:.2f}", f"{row['c_serialize_us']:.2f}"]
        cells.append(f"{row['b_serialize_us'] / row['a_serialize_us']:.0f}×")
        if has_c:
            cells += [f"{row['c_parse_us'] / row['a_parse_us']:.2f}×", f"{row['c_serialize_us'] / row['a_serialize_us']:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    first, last = rows[0], rows[-1]
    lines += [
        "",
        f"(a) per-token growth {first['tokens']}→{last['tokens']} tokens: "
        f"{last['a_serialize_us'] / first['a_serialize_us']:.2f}× (flat is ≤ 1.5×)",
        f"(b)/(a) grows {first['b_serialize_us'] / first['a_serialize_us']:.0f}× → "
        f"{last['b_serialize_us'] / last['a_serialize_us']:.0f}×",
    ]
    if has_c:
        same = all(same_answer(row["result"], row["vllm_result"]) for row in rows)
        lines.append(f"same reasoning, content and tool calls as vLLM at every length: {'yes' if same else 'NO'}")
    else:
        lines.append("(c) skipped: no vLLM venv found (run scripts/setup_vllm.sh or set ONEHOP_VLLM_PYTHON)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="comma-separated output lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="best-of repeats for (a) and short (b) runs")
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM 0.32 venv for (c)")
    parser.add_argument("--no-vllm", action="store_true", help="skip (c) even if a vLLM venv exists")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    vllm_python = None if args.no_vllm else (args.vllm_python or default_vllm_python())
    results = measure(lengths, vllm_python, args.repeats)
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
