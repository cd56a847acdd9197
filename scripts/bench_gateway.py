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

Then the cost of tracing: two more gateways in front of the same engine, one
with tracing off and one tracing every request (`tracing: {endpoint: ...,
sample_ratio: 1.0}`), exporting over OTLP/HTTP to a sink process (this
script with `--otlp-sink PORT`) that answers 200 and counts the spans it
decodes. The derender route runs through them in alternating cells (off, on,
off, on, ...; a first unmeasured round warms both up). Each gateway's CPU is
read at the start of each of its cells, so a round's window also holds what
its exporter thread did while the other gateway was measured; after the last
round the benchmark waits until the sink holds every traced request's server
span, then takes the final reading. Reported: CPU per request (warm-ups
included, they are traced too) on / off over all rounds, the spread of the
per-round ratios, and the gateway spans the sink received per traced
request. OTEL_* variables are removed from every process's environment; the
engine is untraced.

    .venv/bin/python scripts/bench_gateway.py [--quick] [--tracing-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import gzip
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

from plumbing.http_server import new_event_loop  # noqa: E402
from wire.openai_schema import CHAT_COMPLETION_REQUEST_DECODER, ChatCompletionRequest  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from gateway.upstream.engine_request import chat_sampling, generate_body  # noqa: E402
from gateway.render.local import LocalRenderer  # noqa: E402

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
SPANS_TIMEOUT_S = 30.0  # the batch span processor exports every 5 s (OTEL_BSP_SCHEDULE_DELAY's default)

TRACING_TARGET_RATIO = 1.05
TRACING_ROUTE = "derender"
GATEWAY_SERVICE = "onehop-gateway"
SPAN_KIND_SERVER = 2


@dataclass(frozen=True)
class Plan:
    tokens: int
    itl_ms: float
    ttft_ms: float
    requests: dict[int, int]
    """Measured requests per cell, by concurrency."""
    warmup: int
    """Unmeasured requests each worker makes first (connections, the burst of the cell's start)."""
    tracing_streams: int
    tracing_requests: int
    """Measured requests per tracing cell (each worker's warm-up request comes on top)."""
    tracing_rounds: int
    """Measured (off, on) rounds, after one unmeasured round."""


FULL = Plan(
    tokens=1000,
    itl_ms=2,
    ttft_ms=20,
    requests={1: 8, 32: 96, 256: 256},
    warmup=1,
    tracing_streams=32,
    tracing_requests=96,
    tracing_rounds=6,
)
QUICK = Plan(
    tokens=100,
    itl_ms=1,
    ttft_ms=5,
    requests={1: 3, 32: 32, 256: 256},
    warmup=1,
    tracing_streams=32,
    tracing_requests=64,
    tracing_rounds=3,
)


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

    def sent(self, plan: Plan) -> int:
        """Requests the gateway served in the cell, warm-ups included."""
        return self.requests + plan.warmup * self.concurrency


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

    def through(self, gateway_url: str) -> Requests:
        """The same requests, sent to another gateway."""
        other = copy.copy(self)
        other._gateway_url = gateway_url + "/v1/chat/completions"
        return other

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
            derender_fields={"chat_request": msgspec.Raw(self.chat)},
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


def child_env() -> dict[str, str]:
    """This environment without OTEL_*: only a config's `tracing:` turns tracing on."""
    return {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}


def spawn(args: list[str], log: Path, *, module: bool = True, root: Path = ROOT) -> subprocess.Popen[bytes]:
    """`root`: the source tree the process runs (another commit's, to compare two side by side)."""
    command = [sys.executable, *(["-m", "onehop"] if module else []), *args]
    env = child_env()
    if root != ROOT:
        env["PYTHONPATH"] = str(root)  # its packages before the installed ones
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=root, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def start_engine(tokenizer_dir: Path, port: int, plan: Plan, log: Path) -> subprocess.Popen[bytes]:
    options = {"mode": "auto", "output_tokens": plan.tokens, "itl_ms": plan.itl_ms, "ttft_ms": plan.ttft_ms}
    args = ["engine", "--backend", "sim", "--model", str(tokenizer_dir), "--served-model-name", MODEL, "--port", str(port)]
    for key, value in options.items():
        args += ["--backend-option", f"{key}={json.dumps(value)}"]
    return spawn(args, log)


def start_gateway(
    tokenizer_dir: Path,
    engine_url: str,
    port: int,
    folder: Path,
    *,
    name: str = "gateway",
    tracing: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    workers: int = 1,
    root: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """A gateway in front of `engine_url` (one process unless `workers` says more: then the
    supervisor's); `extra` adds or replaces top-level config keys."""
    config: dict[str, Any] = {
        "model": MODEL,
        "tokenizer": str(tokenizer_dir),
        "engines": [{"url": engine_url}],
        "host": "127.0.0.1",
        "port": port,
        "route": "derender",
        "route_header": True,
    }
    if tracing is not None:
        config["tracing"] = tracing
    config |= extra or {}
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return spawn(["gateway", "--config", str(path), "--workers", str(workers)], folder / f"{name}.log", root=root)


def start_sink(port: int, log: Path) -> subprocess.Popen[bytes]:
    return spawn([str(Path(__file__).resolve()), "--otlp-sink", str(port)], log, module=False)


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


# ------------------------------------------------------------ OTLP sink


def serve_otlp_sink(port: int) -> None:
    """An OTLP/HTTP traces receiver: POST /v1/traces answers 200 (empty body) and counts the
    spans it decodes, per service; GET /stats returns the counts as JSON."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    stats: dict[str, Any] = {"exports": 0, "bytes": 0, "services": {}}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        stats["exports"] += 1
        stats["bytes"] += len(body)
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
            )
            counts = stats["services"].setdefault(service, {"spans": 0, "server_spans": 0, "names": {}})
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    counts["spans"] += 1
                    counts["server_spans"] += span.kind == SPAN_KIND_SERVER
                    counts["names"][span.name] = counts["names"].get(span.name, 0) + 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def read_stats(_: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", read_stats)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=new_event_loop())


async def sink_stats(session: aiohttp.ClientSession, sink_url: str) -> dict[str, Any]:
    async with session.get(sink_url + "/stats") as resp:
        if resp.status != 200:
            raise BenchError(f"the OTLP sink answered {resp.status}")
        stats: dict[str, Any] = await resp.json()
        return stats


def gateway_spans(stats: dict[str, Any]) -> dict[str, Any]:
    return stats["services"].get(GATEWAY_SERVICE, {"spans": 0, "server_spans": 0, "names": {}})


async def wait_spans(session: aiohttp.ClientSession, sink_url: str, requests: int) -> dict[str, Any]:
    """The sink's counts once it holds a gateway server span per traced request (or at the timeout:
    spans the exporter dropped then show as fewer spans per request)."""
    deadline = time.monotonic() + SPANS_TIMEOUT_S
    while True:
        stats = await sink_stats(session, sink_url)
        if gateway_spans(stats)["server_spans"] >= requests or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


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


async def measure(plan: Plan, concurrency: Sequence[int], *, matrix: bool = True) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench_gateway_") as tmp:
        folder = Path(tmp)
        engine = start_engine(tokenizer_dir, engine_port, plan, folder / "engine.log")
        gateway = start_gateway(tokenizer_dir, engine_url, gateway_port, folder) if matrix else None
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                requests = Requests(tokenizer_dir, engine_url, gateway_url, plan.tokens)
                if gateway is not None:
                    await wait_ready(session, gateway_url, gateway, folder / "gateway.log")
                    for streams in concurrency:
                        for target in TARGETS:
                            cell = Cell(target, streams)
                            await run_cell(session, requests, cell, plan, gateway.pid)
                            cells.append(cell)
                            print(
                                f"measured {target} x{streams}: {cell.requests} requests in {cell.wall_s:.1f} s",
                                file=sys.stderr,
                            )
                    stop(gateway)  # idle from here on; its CPU and memory are the tracing gateways' now
                tracing = await measure_tracing(session, requests, plan, tokenizer_dir, engine_url, folder)
        finally:
            if gateway is not None:
                stop(gateway)
            stop(engine)
    return {
        "plan": asdict(plan),
        "cpus": os.cpu_count(),
        "cells": [asdict(c) for c in cells],
        "rows": summarize(cells),
        "tracing": tracing,
    }


async def measure_tracing(
    session: aiohttp.ClientSession, requests: Requests, plan: Plan, tokenizer_dir: Path, engine_url: str, folder: Path
) -> dict[str, Any]:
    """Gateway CPU per derender request with tracing off and at 100% sampling, in alternating cells."""
    sink_port = free_port()
    sink_url = f"http://127.0.0.1:{sink_port}"
    tracing = {"endpoint": sink_url + "/v1/traces", "sample_ratio": 1.0}
    sink = start_sink(sink_port, folder / "otlp_sink.log")
    ports = {"off": free_port(), "on": free_port()}
    gateways = {
        name: start_gateway(
            tokenizer_dir,
            engine_url,
            port,
            folder,
            name=f"gateway_tracing_{name}",
            tracing=tracing if name == "on" else None,
        )
        for name, port in ports.items()
    }
    try:
        await wait_ready(session, sink_url, sink, folder / "otlp_sink.log")
        for name, process in gateways.items():
            await wait_ready(session, f"http://127.0.0.1:{ports[name]}", process, folder / f"gateway_tracing_{name}.log")
        through = {name: requests.through(f"http://127.0.0.1:{port}") for name, port in ports.items()}
        # Each gateway's CPU at the start of each of its measured cells, then at the end.
        marks: dict[str, list[float]] = {"off": [], "on": []}
        sent: dict[str, list[int]] = {"off": [], "on": []}
        cells: dict[str, list[Cell]] = {"off": [], "on": []}
        traced = 0
        cell_plan = dataclasses.replace(plan, requests={**plan.requests, plan.tracing_streams: plan.tracing_requests})
        for round_ in range(plan.tracing_rounds + 1):
            if round_ == 1:  # the warm-up round's spans out of the way: each window exports its own
                await wait_spans(session, sink_url, traced)
            for name in ("off", "on"):
                pid = gateways[name].pid
                if round_ > 0:
                    marks[name].append(process_cpu(pid))
                cell = Cell(TRACING_ROUTE, plan.tracing_streams)
                await run_cell(session, through[name], cell, cell_plan, pid)
                traced += cell.sent(plan) if name == "on" else 0
                if round_ > 0:
                    sent[name].append(cell.sent(plan))
                    cells[name].append(cell)
            print(f"measured tracing round {round_}{' (warm-up)' if round_ == 0 else ''}", file=sys.stderr)
        stats = await wait_spans(session, sink_url, traced)
        for name in ("off", "on"):
            marks[name].append(process_cpu(gateways[name].pid))
    finally:
        for process in gateways.values():
            stop(process)
        stop(sink)
    return summarize_tracing(plan, marks, sent, cells, stats, traced)


def summarize_tracing(
    plan: Plan,
    marks: dict[str, list[float]],
    sent: dict[str, list[int]],
    cells: dict[str, list[Cell]],
    stats: dict[str, Any],
    traced: int,
) -> dict[str, Any]:
    def window_cpu(name: str) -> list[float]:
        return [after - before for before, after in itertools.pairwise(marks[name])]

    cpu = {name: window_cpu(name) for name in ("off", "on")}
    per_request = {name: sum(cpu[name]) / sum(sent[name]) for name in ("off", "on")}
    rounds = [
        (on / on_sent) / (off / off_sent) if off > 0 else math.nan
        for off, off_sent, on, on_sent in zip(cpu["off"], sent["off"], cpu["on"], sent["on"], strict=True)
    ]
    spans = gateway_spans(stats)
    e2e = {name: [s for c in cells[name] for s in c.e2e_s] for name in ("off", "on")}
    return {
        "route": TRACING_ROUTE,
        "concurrency": plan.tracing_streams,
        "rounds": plan.tracing_rounds,
        "requests_per_gateway": sum(sent["on"]),
        "sample_ratio": 1.0,
        "gateway_cpu_s": {name: sum(cpu[name]) for name in ("off", "on")},
        "off_cpu_ms_per_request": per_request["off"] * 1000,
        "on_cpu_ms_per_request": per_request["on"] * 1000,
        "added_cpu_ms_per_request": (per_request["on"] - per_request["off"]) * 1000,
        "cpu_ratio": per_request["on"] / per_request["off"] if per_request["off"] > 0 else math.nan,
        "round_ratios": rounds,
        "ratio_min": min(rounds),
        "ratio_max": max(rounds),
        "traced_requests": traced,  # through the traced gateway, its warm-up round included
        "spans_exported": spans["spans"],
        "spans_per_request": spans["spans"] / traced,
        "span_names_per_request": {name: count / traced for name, count in sorted(spans["names"].items())},
        "exports": stats["exports"],
        "export_bytes_per_request": stats["bytes"] / traced,
        "e2e_p50_ms": {name: percentile(e2e[name], 50) * 1000 for name in ("off", "on")},
    }


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
    tracing = [tracing_line(results["tracing"], plan["tokens"])]
    if not results["rows"]:
        return "\n".join(tracing)
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
    lines += ["", targets_line(results["rows"], plan["tokens"]), *tracing]
    return "\n".join(lines)


def tracing_line(tracing: dict[str, Any], tokens: int) -> str:
    return (
        f"tracing at 100% sampling: gateway CPU/request ×{tracing['cpu_ratio']:.3f}"
        f" (target <= {TRACING_TARGET_RATIO:g}; rounds ×{tracing['ratio_min']:.3f}–×{tracing['ratio_max']:.3f}),"
        f" {tracing['spans_per_request']:.2f} spans/request exported"
        f" ({tracing['off_cpu_ms_per_request']:.2f} → {tracing['on_cpu_ms_per_request']:.2f} ms,"
        f" {tracing['added_cpu_ms_per_request']:+.2f} ms per request; {tracing['route']} route, {tokens}-token streams,"
        f" {tracing['concurrency']} streams, {tracing['rounds']} rounds, {tracing['requests_per_gateway']} requests per gateway)"
    )


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
    parser.add_argument("--tracing-only", action="store_true", help="only the tracing cost, not the route table")
    parser.add_argument("--otlp-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the sink process
    args = parser.parse_args(argv)
    if args.otlp_sink is not None:
        serve_otlp_sink(args.otlp_sink)
        return 0
    plan = QUICK if args.quick else FULL
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(plan, CONCURRENCY, matrix=not args.tracing_only))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
