"""Gateway CPU per streamed token, by API, on one route: chat beside Responses and Messages.

Chat on the `derender` route is a byte relay: the engine writes the client's chunks. The
Responses and Messages APIs are answered from the same engine chunks, translated by the
gateway into their own events; this measures what that translation costs the gateway.
One gateway process (`--workers 1`) in front of the sim engine (N tokens per answer at a fixed
inter-token delay); per API and concurrency, closed-loop clients stream answers back to back,
rounds interleaved, and the gateway's CPU (utime + stime from /proc) is divided by the tokens
and the requests it relayed. The client shares the machine: compare rows of one run.

    .venv/bin/python scripts/bench_apis.py [--quick] [--route derender] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    MODEL,
    BenchError,
    Plan,
    client_session,
    free_port,
    process_cpu,
    start_engine,
    start_gateway,
    stop,
    wait_ready,
)

from plumbing.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

PROMPT = "Tell me a story."
APIS = ("chat", "responses", "messages")
CONCURRENCY = (1, 16)


@dataclass(frozen=True)
class Size:
    tokens: int
    itl_ms: float
    requests: int
    """Per API and concurrency, per round."""
    rounds: int


FULL = Size(tokens=256, itl_ms=1.0, requests=64, rounds=3)
QUICK = Size(tokens=32, itl_ms=0.5, requests=8, rounds=1)


def _bodies(tokens: int) -> dict[str, tuple[str, bytes]]:
    """Each API's path and streamed request for an answer of `tokens` tokens (the sim ignores EOS)."""
    user = [{"role": "user", "content": PROMPT}]
    chat = {"model": MODEL, "messages": user, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    responses = {"model": MODEL, "input": PROMPT, "max_output_tokens": tokens, "stream": True}
    messages = {"model": MODEL, "messages": user, "max_tokens": tokens, "stream": True}
    return {
        "chat": ("/v1/chat/completions", json.dumps(chat).encode()),
        "responses": ("/v1/responses", json.dumps(responses).encode()),
        "messages": ("/v1/messages", json.dumps(messages).encode()),
    }


def _chat_tokens(event: dict[str, Any]) -> int | None:
    usage = event.get("usage")
    return int(usage["completion_tokens"]) if usage else None


def _responses_tokens(event: dict[str, Any]) -> int | None:
    if event.get("type") in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
        return int(event["response"]["usage"]["output_tokens"])
    return None


def _messages_tokens(event: dict[str, Any]) -> int | None:
    if event.get("type") == "message_delta":
        return int(event["usage"]["output_tokens"])
    return None


TOKENS_OF: dict[str, Callable[[dict[str, Any]], int | None]] = {
    "chat": _chat_tokens,
    "responses": _responses_tokens,
    "messages": _messages_tokens,
}


@dataclass
class Cell:
    api: str
    streams: int
    requests: int = 0
    tokens: int = 0
    events: int = 0
    cpu_s: float = 0.0


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], api: str) -> tuple[int, int]:
    """One streamed answer read to its end: (events, completion tokens the API reported)."""
    events, tokens = 0, None
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise BenchError(f"{api}: {response.status} {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            events += 1
            if b'"usage"' in line:  # only the few events that carry usage are decoded
                tokens = TOKENS_OF[api](json.loads(line[6:])) or tokens
    if tokens is None:
        raise BenchError(f"{api}: the stream reported no usage")
    return events, tokens


async def run_cell(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], cell: Cell, count: int, pid: int, tokens: int
) -> None:
    issued = iter(range(count))

    async def client() -> None:
        for _ in issued:
            events, got = await stream_once(session, url, body, headers, cell.api)
            if got != tokens:
                raise BenchError(f"{cell.api}: {got} tokens, not {tokens}")
            cell.requests += 1
            cell.tokens += got
            cell.events += events

    before = process_cpu(pid)
    await asyncio.gather(*(client() for _ in range(cell.streams)))
    cell.cpu_s += process_cpu(pid) - before


async def measure(size: Size, route: str) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    plan = Plan(tokens=size.tokens, itl_ms=size.itl_ms, ttft_ms=0, requests={}, warmup=0,
                tracing_streams=0, tracing_requests=0, tracing_rounds=0)
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    bodies = _bodies(size.tokens)
    headers = {"Content-Type": "application/json", "onehop-route": route}
    cells: dict[tuple[str, int], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="bench_apis_") as tmp:
        folder = Path(tmp)
        engine = start_engine(tokenizer_dir, engine_port, plan, folder / "engine.log")
        gateway = None
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                gateway = start_gateway(tokenizer_dir, engine_url, gateway_port, folder)
                await wait_ready(session, gateway_url, gateway, folder / "gateway.log")
                for measured in [False] + [True] * size.rounds:
                    for streams in CONCURRENCY:
                        for api in APIS:
                            path, body = bodies[api]
                            cell = cells.setdefault((api, streams), Cell(api, streams)) if measured else Cell(api, streams)
                            count = size.requests if measured else streams
                            await run_cell(session, gateway_url + path, body, headers, cell, count, gateway.pid, size.tokens)
                    print(f"{'measured' if measured else 'warmed'}", file=sys.stderr)
        finally:
            if gateway is not None:
                stop(gateway)
            stop(engine)
    return {"size": asdict(size), "route": route, "rows": [_row(cell) for cell in cells.values()]}


def _row(cell: Cell) -> dict[str, Any]:
    return {
        "api": cell.api,
        "streams": cell.streams,
        "requests": cell.requests,
        "events_per_request": cell.events / cell.requests,
        "cpu_us_per_token": cell.cpu_s / cell.tokens * 1e6,
        "cpu_ms_per_request": cell.cpu_s / cell.requests * 1e3,
    }


def report(results: dict[str, Any]) -> str:
    size = results["size"]
    lines = [
        f"route {results['route']}, {size['tokens']} tokens per answer at {size['itl_ms']} ms, "
        f"{size['requests']} requests x {size['rounds']} rounds per cell",
        "| API | streams | events/request | gateway CPU µs/token | gateway CPU ms/request | × chat |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    chat = {row["streams"]: row["cpu_us_per_token"] for row in results["rows"] if row["api"] == "chat"}
    for row in sorted(results["rows"], key=lambda r: (r["streams"], APIS.index(r["api"]))):
        ratio = row["cpu_us_per_token"] / chat[row["streams"]] if chat.get(row["streams"]) else float("nan")
        lines.append(
            f"| {row['api']} | {row['streams']} | {row['events_per_request']:.0f} | {row['cpu_us_per_token']:.1f} "
            f"| {row['cpu_ms_per_request']:.2f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer, shorter answers)")
    parser.add_argument("--route", default="derender", choices=("derender", "text", "tokens"))
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(QUICK if args.quick else FULL, args.route))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
