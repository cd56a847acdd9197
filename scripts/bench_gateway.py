"""Gateway overhead on streamed chat: TTFT, end-to-end latency and gateway CPU, per route and concurrency.

Starts two processes, each in its own process group, killed at the end:

- `onehop engine --backend sim` in auto mode with `output_tokens=N`; the
  request renders with `enable_thinking: false` and asks for `max_tokens=N`
  with `ignore_eos`, so every answer is exactly N content tokens (checked on
  every request from `usage.completion_tokens`);
- `onehop gateway` in front of it, the route picked per request with the
  `onehop-route` header.

Each cell streams the same chat request, closed loop (every worker makes one
unmeasured warm-up request, which opens its connections and absorbs the
cell's start-up burst, then issues requests back to back until the cell's
measured count is spent), against:

- `direct`: the engine's `/inference/v1/generate` with `output_mode:
  derender` and the same chat request, built by the gateway's own render and
  `generate_body` (exactly what the gateway would send);
- the gateway's `/v1/chat/completions` on the derender, text and tokens routes.

Per request: TTFT (to the first SSE event whose delta carries content,
reasoning or tool calls) and E2E (to the end of the stream), with
`time.perf_counter`. Per cell: the gateway process's utime + stime from
`/proc/<pid>/stat` before and after, divided by the SSE events delivered.
The client runs in this process, so on a small machine it competes with the
engine and the gateway for CPU: compare rows of one run, not runs.

    .venv/bin/python scripts/bench_gateway.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import msgspec  # noqa: E402

from engine.app import new_event_loop  # noqa: E402
from engine.openai_schema import CHAT_COMPLETION_REQUEST_DECODER, ChatCompletionRequest  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from gateway.engine_request import chat_sampling, generate_body  # noqa: E402
from gateway.render import LocalRenderer  # noqa: E402

DIRECT = "direct"
ROUTES = ("derender", "text", "tokens")
TARGETS = (DIRECT, *ROUTES)
CONCURRENCY = (1, 32, 256)
MODEL = "sim"

TTFT_TARGET_MS = 1.0
E2E_TARGET_PCT = 2.0

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0  # one SSE line; a 256-stream cell on 2 cores can stall a stream for seconds
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Plan:
    tokens: int
    itl_ms: float
    ttft_ms: float
    requests: dict[int, int]
    """Measured requests per cell, by concurrency."""
    warmup: int
    """Unmeasured requests each worker makes first (connections, the burst of the cell's start)."""


FULL = Plan(tokens=1000, itl_ms=2, ttft_ms=20, requests={1: 8, 32: 96, 256: 256}, warmup=1)
QUICK = Plan(tokens=100, itl_ms=1, ttft_ms=5, requests={1: 3, 32: 32, 256: 256}, warmup=1)


class BenchError(RuntimeError):
    """The benchmark could not produce a valid measurement (a server failed, an answer was off)."""


@dataclass
class Cell:
    target: str
    concurrency: int
    requests: int = 0
    """Measured requests (warm-up excluded)."""
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    events: int = 0
    """SSE events delivered in the cell, warm-up included (the gateway's CPU covers it too)."""
    gateway_cpu_s: float = 0.0
    wall_s: float = 0.0


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    e2e_s: float
    events: int
    completion_tokens: int


# ------------------------------------------------------------ SSE client


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _ChunkView(msgspec.Struct):
    """Only what the client measures: does this chunk carry output, and the final usage."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: msgspec.Raw | None = None


_CHUNK = msgspec.json.Decoder(_ChunkView)
_DATA = b"data: "
_DONE = b"data: [DONE]"


def _has_output(chunk: _ChunkView) -> bool:
    for choice in chunk.choices:
        delta = choice.delta
        if delta is not None and (delta.content or delta.reasoning or delta.reasoning_content or delta.tool_calls):
            return True
    return False


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> Sample:
    """One streamed request; TTFT at the first output-bearing event, E2E at the end of the stream."""
    start = time.perf_counter()
    first: float | None = None
    events = 0
    last = b""
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise BenchError(f"{url} answered {resp.status}: {(await resp.text())[:500]}")
        # Hot loop: one bytes line per SSE line; JSON is decoded only until the first output.
        # Read to EOF, past [DONE]: a response left unfinished would close its pooled connection.
        async for line in resp.content:
            if not line.startswith(_DATA) or line.startswith(_DONE):
                continue
            events += 1
            last = line
            if first is None and _has_output(_decode(line)):
                first = time.perf_counter()
    end = time.perf_counter()
    final = _decode(last) if last else _ChunkView()
    if first is None or final.usage is None:
        raise BenchError(f"{url}: a stream of {events} events without output or usage (last: {last[:300]!r})")
    return Sample(first - start, end - start, events, final.usage.completion_tokens)


def _decode(line: bytes) -> _ChunkView:
    chunk = _CHUNK.decode(line[len(_DATA) :])
    if chunk.error is not None:
        raise BenchError(f"an in-band error: {bytes(chunk.error)[:500]!r}")
    return chunk


# ------------------------------------------------------------ requests


def chat_request(tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": tokens,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    return msgspec.json.encode(body)


class Requests:
    """Bodies per target: the chat request for the gateway, what the gateway sends for `direct`."""

    def __init__(self, tokenizer_dir: Path, engine_url: str, gateway_url: str, tokens: int) -> None:
        self.chat = chat_request(tokens)
        request = CHAT_COMPLETION_REQUEST_DECODER.decode(self.chat)
        assert isinstance(request, ChatCompletionRequest)
        renderer = LocalRenderer(tokenizer_dir)
        try:
            self._prompt = renderer.chat_sync(request)
        finally:
            renderer.close()
        self._sampling = chat_sampling(request)
        self._engine_url = engine_url + "/inference/v1/generate"
        self._gateway_url = gateway_url + "/v1/chat/completions"

    def url(self, target: str) -> str:
        return self._engine_url if target == DIRECT else self._gateway_url

    def headers(self, target: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if target != DIRECT:
            headers["onehop-route"] = target
        return headers

    def body(self, target: str) -> bytes:
        if target != DIRECT:
            return self.chat
        return generate_body(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            model=None,
            prompt_ids=self._prompt,
            sampling=self._sampling,
            route="derender",
            stream=True,
            include_usage=True,
            chat_request=self.chat,
        )


# ------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; clock-tick resolution."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "gateway", *args]
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def start_engine(tokenizer_dir: Path, port: int, plan: Plan, log: Path) -> subprocess.Popen[bytes]:
    options = {"mode": "auto", "output_tokens": plan.tokens, "itl_ms": plan.itl_ms, "ttft_ms": plan.ttft_ms}
    args = ["engine", "--backend", "sim", "--model", str(tokenizer_dir), "--served-model-name", MODEL, "--port", str(port)]
    for key, value in options.items():
        args += ["--backend-option", f"{key}={json.dumps(value)}"]
    return spawn(args, log)


def start_gateway(tokenizer_dir: Path, engine_url: str, port: int, folder: Path) -> subprocess.Popen[bytes]:
    config = {
        "model": MODEL,
        "tokenizer": str(tokenizer_dir),
        "engines": [{"url": engine_url}],
        "host": "127.0.0.1",
        "port": port,
        "route": "derender",
        "route_header": True,
    }
    path = folder / "gateway.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return spawn(["gateway", "--config", str(path)], folder / "gateway.log")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"{url} exited with {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise BenchError(f"{url} was not ready within {READY_TIMEOUT_S} s")


# ------------------------------------------------------------ measuring


def check_tokens(sample: Sample, tokens: int) -> None:
    if sample.completion_tokens != tokens:
        raise BenchError(f"a request produced {sample.completion_tokens} tokens, not {tokens}")


async def run_cell(session: aiohttp.ClientSession, requests: Requests, cell: Cell, plan: Plan, gateway_pid: int) -> None:
    """Closed loop: `cell.concurrency` workers, back to back, until the cell's measured count was issued."""
    issued = itertools.count()
    total = plan.requests[cell.concurrency]
    url, headers = requests.url(cell.target), requests.headers(cell.target)

    async def one() -> Sample:
        sample = await stream_once(session, url, requests.body(cell.target), headers)
        check_tokens(sample, plan.tokens)
        cell.events += sample.events
        return sample

    async def worker() -> None:
        for _ in range(plan.warmup):
            await one()
        while next(issued) < total:
            sample = await one()
            cell.ttft_s.append(sample.ttft_s)
            cell.e2e_s.append(sample.e2e_s)

    cpu_before = process_cpu(gateway_pid)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
    cell.wall_s = time.perf_counter() - start
    cell.gateway_cpu_s = process_cpu(gateway_pid) - cpu_before
    cell.requests = len(cell.e2e_s)


def client_session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))


async def measure(plan: Plan, concurrency: Sequence[int]) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench_gateway_") as tmp:
        folder = Path(tmp)
        engine = start_engine(tokenizer_dir, engine_port, plan, folder / "engine.log")
        gateway = start_gateway(tokenizer_dir, engine_url, gateway_port, folder)
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                await wait_ready(session, gateway_url, gateway, folder / "gateway.log")
                requests = Requests(tokenizer_dir, engine_url, gateway_url, plan.tokens)
                for streams in concurrency:
                    for target in TARGETS:
                        cell = Cell(target, streams)
                        await run_cell(session, requests, cell, plan, gateway.pid)
                        cells.append(cell)
                        print(f"measured {target} x{streams}: {cell.requests} requests in {cell.wall_s:.1f} s", file=sys.stderr)
        finally:
            stop(gateway)
            stop(engine)
    return {"plan": asdict(plan), "cpus": os.cpu_count(), "cells": [asdict(c) for c in cells], "rows": summarize(cells)}


# ------------------------------------------------------------ report


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    direct = {c.concurrency: c for c in cells if c.target == DIRECT}
    rows = []
    for cell in cells:
        base = direct[cell.concurrency]
        ttft_p50, e2e_p50 = percentile(cell.ttft_s, 50) * 1000, percentile(cell.e2e_s, 50) * 1000
        row: dict[str, Any] = {
            "route": cell.target,
            "concurrency": cell.concurrency,
            "requests": cell.requests,
            "events": cell.events,
            "ttft_p50_ms": ttft_p50,
            "ttft_p90_ms": percentile(cell.ttft_s, 90) * 1000,
            "ttft_p99_ms": percentile(cell.ttft_s, 99) * 1000,
            "e2e_p50_ms": e2e_p50,
            "e2e_p90_ms": percentile(cell.e2e_s, 90) * 1000,
            "e2e_p99_ms": percentile(cell.e2e_s, 99) * 1000,
            "added_ttft_p50_ms": ttft_p50 - percentile(base.ttft_s, 50) * 1000,
            "e2e_p50_ratio": e2e_p50 / (percentile(base.e2e_s, 50) * 1000),
            # Direct requests bypass the gateway: its CPU then is only idle noise.
            "gateway_cpu_ms_per_1k_chunks": None if cell.target == DIRECT else cell.gateway_cpu_s / cell.events * 1e6,
        }
        rows.append(row)
    return rows


def report(results: dict[str, Any]) -> str:
    plan = results["plan"]
    lines = [
        f"Streamed chat, {plan['tokens']} output tokens per request, sim engine (itl_ms={plan['itl_ms']},"
        f" ttft_ms={plan['ttft_ms']}) and gateway in their own processes, {results['cpus']} CPUs, closed loop",
        "",
        "| route | streams | requests | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (ms) | E2E p99 (ms)"
        " | added TTFT p50 vs direct (ms) | E2E p50 vs direct | gateway CPU per 1k chunks (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        direct = row["route"] == DIRECT
        cpu = row["gateway_cpu_ms_per_1k_chunks"]
        added = "—" if direct else f"{row['added_ttft_p50_ms']:+.2f}"
        ratio = "—" if direct else f"{row['e2e_p50_ratio']:.3f}×"
        lines.append(
            f"| {row['route']} | {row['concurrency']} | {row['requests']} | {row['ttft_p50_ms']:.2f} | {row['ttft_p99_ms']:.2f}"
            f" | {row['e2e_p50_ms']:.1f} | {row['e2e_p99_ms']:.1f} | {added} | {ratio}"
            f" | {'—' if cpu is None else f'{cpu:.1f}'} |"
        )
    lines += ["", targets_line(results["rows"], plan["tokens"])]
    return "\n".join(lines)


def targets_line(rows: Sequence[dict[str, Any]], tokens: int) -> str:
    """The headline: the derender route at the fewest streams, where queueing blurs least; then the others."""
    derender = sorted((r for r in rows if r["route"] == "derender"), key=lambda r: r["concurrency"])
    first, *others = derender
    rest = "; ".join(
        f"{r['concurrency']} streams: {r['added_ttft_p50_ms']:+.2f} ms, {(r['e2e_p50_ratio'] - 1) * 100:+.2f}%" for r in others
    )
    return (
        f"derender route adds {first['added_ttft_p50_ms']:.2f} ms p50 TTFT (target < {TTFT_TARGET_MS:g} ms)"
        f" and {(first['e2e_p50_ratio'] - 1) * 100:.2f}% p50 E2E on {tokens}-token streams (target < {E2E_TARGET_PCT:g}%)"
        f" at {first['concurrency']} stream{'s' if first['concurrency'] != 1 else ''}" + (f" ({rest})" if rest else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer, shorter requests) for CI")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(plan, CONCURRENCY))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
