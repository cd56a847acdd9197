"""Relay cost: onehop's gateway beside the Rust routers users would pick instead.

Side by side in one run, rounds interleaved, each setup relaying streams of
N chunks at a fixed inter-token delay:

- `vllm-router` and `smg` (installed by this script into their own venv,
  given no tokenizer) in front of a fast scripted server: this script with
  `--upstream PORT`, which streams N `chat.completion.chunk` events per chat
  request, then `[DONE]`;
- onehop's gateway (one process, `--workers 1`) on the `derender` route (the
  engine's OpenAI chunks relayed as bytes), the `text` route (the gateway
  parses text deltas) and the `tokens` route (it detokenizes and parses),
  twice: in front of the sim engine (`onehop engine --backend sim`, N
  content tokens per answer), and in front of the same scripted server as
  the routers, which also answers the engine's generate API (same cadence,
  same code path, the sim engine's capabilities and metrics text);
- `floor`: the least any Python relay on uvloop can cost, a TCP pump
  (`--pump`: each read from one socket written to the other, no HTTP, no
  check), once in front of each producer. How a producer spreads its writes
  decides how many chunks a relay finds per wake-up, so the floors differ;
  a relay's own cost is what it spends over the floor of its producer;
- `direct`: the scripted server itself, and the engine's own derender stream
  (what the gateway would ask of it), for the latency each hop adds.

Per setup and concurrency (closed loop, each client streaming back to back):
CPU per relayed chunk and per request of the relaying process tree
(utime + stime from `/proc`), p50 TTFT and E2E added over the direct
stream of the same round, and the RSS of the relaying processes at the end.
The client runs in this process and shares the machine: compare the rows of
one run, not runs.

    .venv/bin/python scripts/bench_relay.py [--quick] [--no-routers] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
from aiohttp import web  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    BenchError,
    Plan,
    Requests,
    child_env,
    client_session,
    free_port,
    percentile,
    start_engine,
    start_gateway,
    stop,
    stream_once,
    wait_ready,
)
from scripts.bench_workers import tree_cpu  # noqa: E402

from plumbing.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

ROUTER_VENV = Path.home() / ".cache" / "onehop" / "router-venv"
ROUTERS = {"vllm-router": "vllm-router==0.1.17", "smg": "smg==1.13.0"}
FLOORS = {"floor: scripted server": "upstream", "floor: sim engine": "engine"}
"""A uvloop TCP pump in front of each producer: the least a Python relay costs a chunk of its
stream. The producers emit differently (how many chunks a relay finds per wake-up), so each
relay's own cost is what it spends over the floor of the producer it is in front of."""
ONEHOP_ROUTES = ("derender", "text", "tokens")
CONCURRENCY = (1, 32, 128)
MODEL = "sim"
TARGETS = {"derender": 1.2, "text": 1.5, "tokens": 1.5}
"""onehop's CPU per relayed chunk, at most this many times vllm-router's."""


@dataclass(frozen=True)
class Size:
    tokens: int
    itl_ms: float
    requests: dict[int, int]
    rounds: int


FULL = Size(tokens=1000, itl_ms=2, requests={1: 3, 32: 64, 128: 128}, rounds=2)
QUICK = Size(tokens=50, itl_ms=1, requests={1: 2, 32: 32, 128: 128}, rounds=1)


@dataclass
class Cell:
    setup: str
    streams: int
    requests: int = 0
    events: int = 0
    cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


# ------------------------------------------------------------ the scripted upstream


def serve_upstream(port: int, tokens: int, itl_ms: float, engine_file: Path | None) -> None:
    """A server that streams `tokens` chunks, `itl_ms` apart, to any OpenAI chat request and, with
    `engine_file` (the sim engine's capabilities and metrics text, the id of " word"), to any
    streamed generate request in the engine's own modes."""
    encode = msgspec.json.Encoder().encode
    engine = json.loads(engine_file.read_text()) if engine_file is not None else None

    def openai_events(rid: str) -> tuple[Callable[[int], bytes], bytes]:
        created = int(time.time())

        def event(i: int) -> bytes:
            delta: dict[str, Any] = {"content": " word"} if i else {"role": "assistant", "content": "word"}
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
            return b"data: " + encode(chunk) + b"\n\n"

        last = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [],
                "usage": {"prompt_tokens": 20, "completion_tokens": tokens, "total_tokens": 20 + tokens}}
        return event, b"data: " + encode(last) + b"\n\n"

    def engine_events(rid: str, mode: str, word_id: int) -> Callable[[int], bytes]:
        def event(i: int) -> bytes:
            choice: dict[str, Any] = {"index": 0, "token_ids": [word_id]}
            if mode == "text":
                choice["text"] = " word"
            if i == tokens - 1:
                choice["finish_reason"] = "length"
            return b"data: " + encode({"output_mode": mode, "request_id": rid, "choices": [choice]}) + b"\n\n"

        return event

    async def stream(http: web.Request, event: Callable[[int], bytes], tail: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http)
        for i in range(tokens):
            await asyncio.sleep(itl_ms / 1000)
            await response.write(event(i))
        await response.write(tail + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def chat(http: web.Request) -> web.StreamResponse:
        await http.read()
        event, tail = openai_events(f"chatcmpl-{time.monotonic_ns()}")
        return await stream(http, event, tail)

    async def generate(http: web.Request) -> web.StreamResponse:
        assert engine is not None
        body = json.loads(await http.read())
        rid, mode = body["request_id"], body["output_mode"]
        summary = {"finish_reasons": ["length"], "prompt_tokens": len(body["token_ids"]), "completion_tokens": tokens}
        tail = b": onehop-engine-summary=" + encode(summary) + b"\n\n"
        if mode == "derender":
            event, usage = openai_events(rid)
            return await stream(http, event, usage + tail)
        return await stream(http, engine_events(rid, mode, engine["word_id"]), tail)

    async def capabilities(http: web.Request) -> web.Response:
        assert engine is not None
        return web.json_response(engine["capabilities"])

    async def metrics(http: web.Request) -> web.Response:
        assert engine is not None
        return web.Response(text=engine["metrics"], content_type="text/plain")

    async def ok(http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(http: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", models)
    if engine is not None:
        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_get("/inference/v1/capabilities", capabilities)
        app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=new_event_loop())


def serve_pump(port: int, upstream_port: int) -> None:
    """A TCP pump to the producer on `upstream_port`: per client connection one upstream
    connection, each read written to the other side as it came (keep-alive passes through)."""

    class Upstream(asyncio.Protocol):
        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client

        def data_received(self, data: bytes) -> None:
            self.client.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.close()

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport  # uvloop's transports are not asyncio.Transport subclasses
            self.upstream: asyncio.Transport | None = None
            self.early: list[bytes] = []
            self.connecting = asyncio.ensure_future(self._connect())  # held: a task nobody holds may be collected

        async def _connect(self) -> None:
            loop = asyncio.get_running_loop()
            upstream, _ = await loop.create_connection(lambda: Upstream(self.transport), "127.0.0.1", upstream_port)
            self.upstream = upstream
            for data in self.early:
                upstream.write(data)
            self.early.clear()

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.early.append(data)
            else:
                self.upstream.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.upstream is not None:
                self.upstream.close()

    loop = new_event_loop()
    server = loop.run_until_complete(loop.create_server(Client, "127.0.0.1", port))
    try:
        loop.run_forever()
    finally:
        server.close()


# ------------------------------------------------------------ processes


def ensure_routers() -> Path:
    """The routers' venv (made on first use): their binaries live in its bin/."""
    binaries = ROUTER_VENV / "bin"
    if all((binaries / name).exists() for name in ROUTERS):
        return binaries
    subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
    subprocess.run([str(binaries / "pip"), "install", "-q", *ROUTERS.values()], check=True)
    return binaries


def spawn_command(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=child_env(), start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def start_router(name: str, binaries: Path, port: int, upstream: str, folder: Path) -> subprocess.Popen[bytes]:
    common = [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream, "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]
    if name == "vllm-router":
        command = [str(binaries / "vllm-router"), *common]
    else:
        command = [str(binaries / "smg"), "launch", *common, "--disable-tokenizer-autoload"]
    return spawn_command(command, folder / f"{name}.log")


async def wait_serving(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until one chat stream goes through (a router may answer /health before it routes)."""
    deadline = time.monotonic() + 120
    body = msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    while True:
        if process.poll() is not None:
            raise BenchError(f"{url} exited with {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            await stream_once(session, url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            return
        except (aiohttp.ClientError, BenchError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def tree_rss_kb(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1])
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                total += tree_rss_kb(int(child))
    return total


# ------------------------------------------------------------ cells


PRODUCERS = {"upstream": "scripted server", "engine": "sim engine"}
DIRECT = {"upstream": "direct-upstream", "engine": "direct-engine"}


@dataclass
class Setup:
    name: str
    url: str
    body: Callable[[], bytes]
    """A body per request (the engine's direct requests need their own request ids)."""
    headers: dict[str, str]
    pid: int | None
    """The relaying process (None: a direct stream)."""
    producer: str
    """What it relays: `upstream` (the scripted server) or `engine` (the sim engine)."""


async def run_cell(session: aiohttp.ClientSession, setup: Setup, cell: Cell, count: int, tokens: int) -> None:
    issued = iter(range(count))

    async def client() -> None:
        for _ in issued:
            sample = await stream_once(session, setup.url, setup.body(), setup.headers)
            if sample.completion_tokens != tokens:
                raise BenchError(f"{setup.name}: {sample.completion_tokens} tokens, not {tokens}")
            cell.requests += 1
            cell.events += sample.events
            cell.ttft_s.append(sample.ttft_s)
            cell.e2e_s.append(sample.e2e_s)

    before = tree_cpu(setup.pid) if setup.pid is not None else 0.0
    await asyncio.gather(*(client() for _ in range(cell.streams)))
    if setup.pid is not None:
        cell.cpu_s += tree_cpu(setup.pid) - before


async def engine_file(session: aiohttp.ClientSession, engine_url: str, tokenizer_dir: Path, folder: Path) -> Path:
    """What the scripted server needs to stand in for the sim engine: its capabilities, its
    metrics text (the gateway scrapes it every second) and the token id of " word"."""
    from tokenizers import Tokenizer

    async with session.get(engine_url + "/inference/v1/capabilities") as response:
        capabilities = await response.json()
    async with session.get(engine_url + "/metrics") as response:
        metrics = await response.text()
    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(" word", add_special_tokens=False).ids
    if len(ids) != 1:
        raise BenchError(f"' word' is {len(ids)} tokens in this tokenizer, not one")
    path = folder / "engine.json"
    path.write_text(json.dumps({"capabilities": capabilities, "metrics": metrics, "word_id": ids[0]}))
    return path


async def measure(size: Size, routers: bool) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    binaries = ensure_routers() if routers else None
    plan = Plan(tokens=size.tokens, itl_ms=size.itl_ms, ttft_ms=0, requests={}, warmup=0,
                tracing_streams=0, tracing_requests=0, tracing_rounds=0)
    names = ("upstream", "engine", *(f"gateway-{p}" for p in PRODUCERS), *FLOORS, *ROUTERS)
    ports = {name: free_port() for name in names}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    cells: dict[tuple[str, int], Cell] = {}
    rss: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench_relay_") as tmp:
        folder = Path(tmp)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            async with client_session() as session:
                procs["engine"] = start_engine(tokenizer_dir, ports["engine"], plan, folder / "engine.log")
                await wait_ready(session, url["engine"], procs["engine"], folder / "engine.log")
                stand_in = await engine_file(session, url["engine"], tokenizer_dir, folder)
                procs["upstream"] = spawn_command(
                    [sys.executable, str(Path(__file__).resolve()), "--upstream", str(ports["upstream"]),
                     "--tokens", str(size.tokens), "--itl-ms", str(size.itl_ms), "--engine-file", str(stand_in)],
                    folder / "upstream.log")
                await wait_serving(session, url["upstream"], procs["upstream"], folder / "upstream.log")
                for floor, producer in FLOORS.items():
                    procs[floor] = spawn_command(
                        [sys.executable, str(Path(__file__).resolve()), "--pump", str(ports[floor]), "--to", str(ports[producer])],
                        folder / f"pump-{producer}.log")
                for producer in PRODUCERS:
                    name = f"gateway-{producer}"
                    procs[name] = start_gateway(tokenizer_dir, url[producer], ports[name], folder, name=name)
                    await wait_ready(session, url[name], procs[name], folder / f"{name}.log")
                if binaries is not None:
                    for name in ROUTERS:
                        procs[name] = start_router(name, binaries, ports[name], url["upstream"], folder)
                setups = _setups(tokenizer_dir, url, procs, size.tokens, routers)
                for name in setups:
                    if name in ROUTERS or name == "floor: scripted server":
                        await wait_serving(session, url[name], procs[name], folder / f"{name}.log")
                for measured in [False] + [True] * size.rounds:
                    for streams in CONCURRENCY:
                        for setup in setups.values():
                            cell = cells.setdefault((setup.name, streams), Cell(setup.name, streams)) if measured else Cell(setup.name, streams)
                            count = size.requests[streams] if measured else streams
                            await run_cell(session, setup, cell, count, size.tokens)
                        print(f"{'measured' if measured else 'warmed'} x{streams}", file=sys.stderr)
                for setup in setups.values():
                    if setup.pid is not None and setup.name not in rss:
                        rss[setup.name] = tree_rss_kb(setup.pid)
        finally:
            for process in procs.values():
                stop(process)
    producers = {setup.name: setup.producer for setup in setups.values()}
    return {"size": asdict(size), "cpus": os.cpu_count(), "rows": _rows(cells, rss, producers)}


def _setups(
    tokenizer_dir: Path, url: dict[str, str], procs: dict[str, subprocess.Popen[bytes]], tokens: int, routers: bool
) -> dict[str, Setup]:
    requests = Requests(tokenizer_dir, url["engine"], url["gateway-engine"], tokens)
    json_headers = {"Content-Type": "application/json"}

    def chat() -> bytes:
        return requests.chat

    def direct() -> bytes:
        return requests.body("direct")

    generate = requests.url("direct")
    openai = "/v1/chat/completions"
    setups = {
        "direct-upstream": Setup("direct-upstream", url["upstream"] + openai, chat, json_headers, None, "upstream"),
        "direct-engine": Setup("direct-engine", generate, direct, requests.headers("direct"), None, "engine"),
    }
    for floor, producer in FLOORS.items():
        pid = procs[floor].pid
        if producer == "upstream":
            setups[floor] = Setup(floor, url[floor] + openai, chat, json_headers, pid, producer)
        else:
            pumped = generate.replace(url["engine"], url[floor])
            setups[floor] = Setup(floor, pumped, direct, requests.headers("direct"), pid, producer)
    if routers:
        for name in ROUTERS:
            setups[name] = Setup(name, url[name] + openai, chat, json_headers, procs[name].pid, "upstream")
    for producer, label in PRODUCERS.items():
        gateway = f"gateway-{producer}"
        for route in ONEHOP_ROUTES:
            name = f"onehop {route}: {label}"
            setups[name] = Setup(name, url[gateway] + openai, chat, requests.headers(route), procs[gateway].pid, producer)
    return setups


def _rows(cells: dict[tuple[str, int], Cell], rss: dict[str, int], producers: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for (name, streams), cell in cells.items():
        row: dict[str, Any] = {"setup": name, "streams": streams, "producer": PRODUCERS[producers[name]],
                               "requests": cell.requests, "events": cell.events,
                               "ttft_p50_ms": percentile(cell.ttft_s, 50) * 1e3, "e2e_p50_ms": percentile(cell.e2e_s, 50) * 1e3}
        if not name.startswith("direct"):
            row["cpu_us_per_chunk"] = cell.cpu_s / cell.events * 1e6
            row["cpu_ms_per_request"] = cell.cpu_s / cell.requests * 1e3
            row["rss_mb"] = rss.get(name, 0) / 1024
        rows.append(row)
    by = {(r["setup"], r["streams"]): r for r in rows}
    for row in rows:
        if row["setup"].startswith("direct"):
            continue
        producer = producers[row["setup"]]
        base = by.get((DIRECT[producer], row["streams"]))
        if base is not None:
            row["ttft_added_ms"] = row["ttft_p50_ms"] - base["ttft_p50_ms"]
            row["e2e_added_ms"] = row["e2e_p50_ms"] - base["e2e_p50_ms"]
        floor = by.get((f"floor: {PRODUCERS[producer]}", row["streams"]))
        if floor is not None and not row["setup"].startswith("floor"):
            row["over_floor_us"] = row["cpu_us_per_chunk"] - floor["cpu_us_per_chunk"]
        peer = by.get(("vllm-router", row["streams"]))
        if peer is not None and peer["cpu_us_per_chunk"] > 0:  # ticks are 10 ms
            row["vs_vllm_router"] = row["cpu_us_per_chunk"] / peer["cpu_us_per_chunk"]
    return rows


def _order(name: str) -> int:
    """Floors, routers, then onehop in front of the routers' producer, then of the sim engine."""
    names = [*FLOORS, *ROUTERS, *(f"onehop {r}: {p}" for p in PRODUCERS.values() for r in ONEHOP_ROUTES)]
    return names.index(name)


def report(results: dict[str, Any]) -> str:
    size = results["size"]
    lines = [
        f"{size['tokens']}-chunk streams at {size['itl_ms']} ms per token, {size['rounds']} rounds, {results['cpus']} CPUs",
        "| setup: producer | streams | CPU per chunk | vs vllm-router | over its producer's floor | CPU per request | p50 TTFT added | p50 E2E added | RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted((r for r in results["rows"] if not r["setup"].startswith("direct")), key=lambda r: (_order(r["setup"]), r["streams"]))
    for r in rows:
        name = r["setup"] if ":" in r["setup"] else f"{r['setup']}: {r['producer']}"
        ratio = f"{r['vs_vllm_router']:.2f}x" if "vs_vllm_router" in r else "-"
        over = f"{r['over_floor_us']:.1f} µs" if "over_floor_us" in r else "-"
        lines.append(
            f"| {name} | {r['streams']} | {r['cpu_us_per_chunk']:.1f} µs | {ratio} | {over} | {r['cpu_ms_per_request']:.1f} ms"
            f" | {r.get('ttft_added_ms', 0):.1f} ms | {r.get('e2e_added_ms', 0):.1f} ms | {r['rss_mb']:.0f} MB |"
        )
    lines.extend(_verdict(results["rows"]))
    return "\n".join(lines)


def _verdict(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Targets, for onehop in front of each producer (the routers' own is the like-for-like one)."""
    if not any("vs_vllm_router" in r for r in rows):
        return ["targets: not checked (no routers in this run)"]
    lines = []
    for producer in PRODUCERS.values():
        misses = [
            f"{r['setup'].split(':')[0]} x{r['streams']}: {r['vs_vllm_router']:.2f}x (target {TARGETS[r['setup'].split()[1].rstrip(':')]}x)"
            for r in rows
            if r["setup"].startswith("onehop") and r["producer"] == producer and "vs_vllm_router" in r
            and r["vs_vllm_router"] > TARGETS[r["setup"].split()[1].rstrip(":")]
        ]
        lines.append(f"targets, onehop in front of the {producer}: " + ("all met" if not misses else "missed: " + "; ".join(misses)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--no-routers", action="store_true", help="onehop only (no router install)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    parser.add_argument("--upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the scripted server
    parser.add_argument("--pump", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the Python floor
    parser.add_argument("--to", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--engine-file", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=FULL.tokens, help=argparse.SUPPRESS)
    parser.add_argument("--itl-ms", type=float, default=FULL.itl_ms, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.upstream is not None:
        serve_upstream(args.upstream, args.tokens, args.itl_ms, args.engine_file)
        return 0
    if args.pump is not None:
        serve_pump(args.pump, args.to)
        return 0
    size = QUICK if args.quick else FULL
    loop = new_event_loop()
    try:
        results = loop.run_until_complete(measure(size, routers=not args.no_routers))
    finally:
        loop.close()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
