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

`--overhead` measures instead, in this process, what the engine's per-step
instrumentation costs as a share of the output work it measures. The same
request (same writer, same backend outputs, one token a step, SSE framing in
the consumer) runs three ways, interleaved, round after round:

- bare: the engine's step loop with no clock and no metric;
- before: the per-step pattern of commit f66ad7d, reconstructed here
  (`_drive_before`): a monotonic read and a prometheus_client
  `Histogram.observe` of the gap per step, and two `time.thread_time` reads
  around each writer step (the writer's own `try/finally`, here a wrapper:
  one more Python call per step than the original, ~0.05 µs);
- after: the engine's own `engine.generate._drive`.

Each is timed by thread CPU over the whole request, with the garbage
collector paused (collected before each run). The cost is the median over
rounds of (variant - bare) / bare, each round's variant against that round's
bare run, so a neighbour that slows the machine for a while slows both.
`metered` is what the after-run put in the output-CPU metric (its sampled
estimate), as a share of the thread CPU the whole request took; the rest is
the backend iteration, which is not output work.

    .venv/bin/python scripts/bench_engine.py --overhead [--rounds 15] [--words 700]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
TAIL = (
    "\n</think>\n\nLet me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
WORDS = [
    "the", "user", "asks", "about", "weather", "in", "Paris", "so", "check", "the", "city", "and", "time", "zone",
    "天气", "巴黎", "🫠", "café", "42", "(x", "+", "y)",
]
MODES: dict[str, dict[str, Any]] = {
    "tokens": {"output_mode": "tokens"},
    "text": {"output_mode": "text"},
    "derender": {"output_mode": "derender"},
    "derender, top_logprobs=20": {"output_mode": "derender", "logprobs": 20},
}


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    from transformers import BatchEncoding

    # [*TOOLS]: a list built for the parameter, typed list[dict | Callable] (invariant) by transformers.
    encoded = tokenizer.apply_chat_template(messages, tools=[*TOOLS], add_generation_prompt=True, tokenize=True)
    assert isinstance(encoded, BatchEncoding)  # tokenize=True answers a dict of ids and mask
    return list(encoded["input_ids"])


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
    command = [sys.executable, "-m", "onehop", "engine", "--backend", "sim", "--model", str(tokenizer_dir), "--port", str(port)]
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


async def gated_stream(gate: asyncio.Semaphore, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with gate:
        await stream_once(session, url, body)


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
    prompt = prompt_ids(tokenizer, messages)
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
                await asyncio.gather(*(gated_stream(gate, session, url, body) for _ in range(requests)))
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


def _logprob_entry(token: int, position: int, k: int) -> Any:
    from wire.protocol import GenerateLogProb, GenerateLogProbsContent

    logprob = -0.05 - ((token * 31 + position * 17) % 101) / 200
    top = [GenerateLogProb(token_id=token, logprob=logprob, rank=1)]
    top += [GenerateLogProb(token_id=(token + rank * 7919) % 151643, logprob=logprob - 1.5 * rank, rank=rank + 1) for rank in range(1, k + 1)]
    return GenerateLogProbsContent(token_id=token, logprob=logprob, rank=1, top_logprobs=top)


def backend_steps(ids: list[int], k: int | None) -> list[Any]:
    """One backend output per token, as the sim backend streams them; the last one finishes."""
    from engine.backends.base import BackendOutput

    last = len(ids) - 1
    return [
        BackendOutput(
            index=0,
            token_ids=[token],
            logprobs=[_logprob_entry(token, i, k)] if k is not None else None,
            finish_reason="stop" if i == last else None,
        )
        for i, token in enumerate(ids)
    ]


class _StepTimed:
    """The writer step of f66ad7d: thread CPU read before and after every call."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.cpu_s = 0.0

    def head(self) -> list[bytes]:
        return self._writer.head()

    def tail(self) -> list[bytes]:
        return self._writer.tail()

    def open_choices(self) -> list[int]:
        return self._writer.open_choices()

    def step(self, output: Any) -> bytes | None:
        start = time.thread_time()
        try:
            return self._writer.step(output)
        finally:
            self.cpu_s += time.thread_time() - start


async def _drive_bare(writer: Any, outputs: Any) -> Any:
    async for batch in outputs:
        for output in batch:
            payload = writer.step(output)
            if payload is not None:
                yield payload
        if not writer.open_choices():
            break
    for payload in writer.tail():
        yield payload


async def _drive_before(metrics: Any, mode: str, writer: Any, outputs: Any, times: Any) -> Any:
    """f66ad7d's step loop (head and first-token metrics trimmed: they run once a request)."""
    itl = metrics.labels(mode)
    produced = 0
    async for batch in outputs:
        now = time.monotonic()
        if times.first is None:
            times.first = now
        else:
            itl.observe(now - times.last)
        times.last = now
        for output in batch:
            produced += len(output.token_ids)
            payload = writer.step(output)
            if payload is not None:
                yield payload
        if not writer.open_choices():
            break
    for payload in writer.tail():
        yield payload


async def _replay(steps: list[Any]) -> Any:
    for output in steps:
        yield [output]


async def _consume(payloads: Any) -> int:
    sent = 0
    async for payload in payloads:
        sent += len(b"data: " + payload + b"\n\n")  # the SSE framing the engine's stream does
    return sent


def measure_overhead(rounds: int, words: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, Histogram
    from transformers import AutoTokenizer

    import msgspec

    from derender.vocab import vocab_for
    from engine.generate import _drive, _Times
    from engine.metrics import _GAP_BUCKETS, EngineMetrics
    from engine.outputs import WriterContext, make_writer
    from wire.protocol import decode_generate_request
    from engine.qwen3.vocab import IM_END_ID

    tokenizer = AutoTokenizer.from_pretrained(ensure_tokenizer())
    context = WriterContext(model="sim", vocab=vocab_for(tokenizer), reasoning_parser="qwen3", tool_parser="hermes")
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    prompt = prompt_ids(tokenizer, messages)
    ids = [*tokenizer.encode(script_text(words)), IM_END_ID]
    old_itl = Histogram("old_itl", "f66ad7d's inter-token histogram", ["mode"], buckets=_GAP_BUCKETS, registry=CollectorRegistry())

    def variants_for(mode: dict[str, Any]) -> dict[str, Callable[[], tuple[Any, Any]]]:
        """One mode's three ways to stream the same steps: no metering, the old metering, the new one."""
        body = request_body(prompt, mode)
        steps = backend_steps(ids, mode.get("logprobs"))

        def request() -> Any:
            return decode_generate_request(msgspec.json.encode(body))

        def bare() -> tuple[None, Any]:
            return None, _drive_bare(make_writer(request(), context), _replay(steps))

        def before() -> tuple[Any, Any]:
            times = _Times(arrived=time.monotonic())
            writer = _StepTimed(make_writer(request(), context))
            return writer, _drive_before(old_itl, mode["output_mode"], writer, _replay(steps), times)

        def after() -> tuple[Any, Any]:
            times = _Times(arrived=time.monotonic())
            generate = request()
            return times, _drive(EngineMetrics(), generate, make_writer(generate, context), _replay(steps), times)

        return {"bare": bare, "before": before, "after": after}

    loop = asyncio.new_event_loop()
    rows = []
    try:
        for label, mode in MODES.items():
            variants = variants_for(mode)
            runs: dict[str, list[float]] = {name: [] for name in variants}
            metered: list[float] = []
            for turn in range(rounds):
                names = list(variants)
                names = names[turn % 3 :] + names[: turn % 3]  # rotate the order: no variant always runs first
                for name in names:
                    meter, payloads = variants[name]()
                    gc.collect()
                    gc.disable()  # a collection lands in whichever variant runs then: noise, not cost
                    start = time.thread_time()
                    loop.run_until_complete(_consume(payloads))
                    spent = time.thread_time() - start
                    gc.enable()
                    runs[name].append(spent)
                    if name == "after":
                        metered.append(meter.output_s / spent)
            bare_runs = runs["bare"]
            rows.append(
                {
                    "mode": label,
                    "tokens": len(ids),
                    "work_us_per_token": statistics.median(bare_runs) / len(ids) * 1e6,
                    "before_pct": _paired_cost(runs["before"], bare_runs),
                    "after_pct": _paired_cost(runs["after"], bare_runs),
                    "metered_share": statistics.median(metered),
                }
            )
            print(f"measured {label}", file=sys.stderr)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return {"rows": rows, "rounds": rounds, "tokens_per_request": len(ids)}


def _paired_cost(variant: list[float], bare: list[float]) -> float:
    """Median over rounds of (variant - bare) / bare, each round against its own bare run:
    neighbours that slow the machine for a while slow both sides of a pair alike."""
    return statistics.median((v - b) / b * 100 for v, b in zip(variant, bare, strict=True))


def report_overhead(results: dict[str, Any]) -> str:
    lines = [
        f"Per-step instrumentation as a share of the output work it measures, one streamed request of "
        f"{results['tokens_per_request']} tokens (one a step), median of {results['rounds']} interleaved rounds",
        "",
        "| mode | output work (µs / token) | before: f66ad7d's pattern | after | after: metered / thread CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['mode']} | {row['work_us_per_token']:.2f} | {row['before_pct']:+.1f}% | {row['after_pct']:+.1f}% |"
            f" {row['metered_share']:.0%} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--overhead", action="store_true", help="measure the per-step instrumentation's cost instead")
    parser.add_argument("--rounds", type=int, default=15, help="--overhead: interleaved rounds per mode")
    args = parser.parse_args(argv)
    if args.overhead:
        results = measure_overhead(args.rounds, args.words)
        print(report_overhead(results))
    else:
        results = asyncio.run(measure(args.requests, args.concurrency, args.words))
        print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
