"""Engine-side CPU per 1k output tokens by output mode, measured in one run on the sim backend.

Starts `onehop engine --backend sim` as its own process, streams the same
chat workload (reasoning, then two tool calls; ~1k output tokens) through
`/inference/v1/generate` in each mode, and reads two figures per mode:

- process CPU of the engine (utime + stime from /proc), everything included:
  HTTP, SSE framing, the simulator itself;
- output-processing CPU, from the engine's own
  `onehop_engine_output_cpu_seconds_total{mode}` (what the cost policy reads).

Modes: tokens, text, derender, and derender with logprobs + top_logprobs=20.

    .venv/bin/python scripts/bench_engine.py [--requests 8] [--concurrency 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
TAIL = (
    "\n</think>\n\nLet me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
WORDS = "the user asks about weather in Paris so check the city and time zone 天气 巴黎 🫠 café 42 (x + y)".split()
MODES = {
    "tokens": {"output_mode": "tokens"},
    "text": {"output_mode": "text"},
    "derender": {"output_mode": "derender"},
    "derender, top_logprobs=20": {"output_mode": "derender", "logprobs": 20},
}


def script_text(words: int) -> str:
    rng = random.Random(0)
    return "<think>\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + TAIL


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_engine(tokenizer_dir: Path, port: int, script: str) -> subprocess.Popen[bytes]:
    options = ["--backend-option", "mode=script", "--backend-option", "script=" + json.dumps([script])]
    command = [sys.executable, "-m", "gateway", "engine", "--backend", "sim", "--model", str(tokenizer_dir), "--port", str(port)]
    return subprocess.Popen(command + options, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(base + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the engine did not become ready")


def request_body(prompt: list[int], mode: dict[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": 4096}
    chat: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "Weather and time in Paris?"}], "tools": TOOLS, "stream": True}
    if "logprobs" in mode:
        sampling["logprobs"] = mode["logprobs"]
        chat.update(logprobs=True, top_logprobs=mode["logprobs"])
    body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling, "stream": True, "output_mode": mode["output_mode"]}
    if mode["output_mode"] == "derender":
        body["chat_request"] = chat
    return body


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    events = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: "):
                events += 1
    return events


async def output_cpu(session: aiohttp.ClientSession, base: str) -> tuple[dict[str, float], dict[str, float]]:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    cpu: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "onehop_engine_output_cpu_seconds_total":
                cpu[sample.labels["mode"]] = sample.value
            if sample.name == "onehop_engine_output_tokens_total":
                tokens[sample.labels["mode"]] = sample.value
    return cpu, tokens


async def measure(requests: int, concurrency: int, words: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer_dir = ensure_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    prompt = list(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])
    script = script_text(words)
    output_tokens = len(tokenizer.encode(script)) + 1
    port = free_port()
    engine = start_engine(tokenizer_dir, port, script)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        await wait_ready(base)
        url = base + "/inference/v1/generate"
        async with aiohttp.ClientSession() as session:
            for body in (request_body(prompt, mode) for mode in MODES.values()):  # warm-up
                await stream_once(session, url, body)
            for label, mode in MODES.items():
                body = request_body(prompt, mode)
                cpu_before, tokens_before = await output_cpu(session, base)
                proc_before = process_cpu(engine.pid)
                gate = asyncio.Semaphore(concurrency)

                async def one() -> None:
                    async with gate:
                        await stream_once(session, url, body)

                await asyncio.gather(*(one() for _ in range(requests)))
                proc = process_cpu(engine.pid) - proc_before
                cpu_after, tokens_after = await output_cpu(session, base)
                key = mode["output_mode"]
                produced = tokens_after.get(key, 0) - tokens_before.get(key, 0)
                rows.append(
                    {
                        "mode": label,
                        "output_tokens": produced,
                        "process_cpu_s_per_1k": proc / produced * 1000,
                        "output_cpu_s_per_1k": (cpu_after.get(key, 0) - cpu_before.get(key, 0)) / produced * 1000,
                    }
                )
                print(f"measured {label}", file=sys.stderr)
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(timeout=30)
    return {"rows": rows, "requests": requests, "concurrency": concurrency, "tokens_per_request": output_tokens}


def report(results: dict[str, Any]) -> str:
    rows = results["rows"]
    base = next(r for r in rows if r["mode"] == "tokens")
    lines = [
        f"Engine CPU per 1k output tokens, sim backend, {results['requests']} streamed requests of "
        f"{results['tokens_per_request']} tokens per mode, concurrency {results['concurrency']}",
        "",
        "| mode | engine process CPU (s / 1k tokens) | output processing CPU (s / 1k tokens) | process CPU vs tokens |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        # /proc counts in clock ticks (10 ms): a very short run can read zero.
        ratio = row["process_cpu_s_per_1k"] / base["process_cpu_s_per_1k"] if base["process_cpu_s_per_1k"] else float("nan")
        lines.append(
            f"| {row['mode']} | {row['process_cpu_s_per_1k']:.4f} | {row['output_cpu_s_per_1k']:.4f} | {ratio:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="streamed requests per mode")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--words", type=int, default=700, help="reasoning words in the scripted output (~1k tokens)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.requests, args.concurrency, args.words))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
