"""Gateway CPU per streamed token, by API, on one route: chat beside Responses and Messages.

On the `derender` route the engine writes each API's own events (chat chunks, Responses
events, Anthropic events) and the gateway relays their bytes; on `text` and `tokens` the
gateway derenders and assembles them itself. One gateway process (`--workers 1`) in front of
the sim engine (N tokens per answer at a fixed inter-token delay); per API and concurrency,
closed-loop clients stream answers back to back, rounds interleaved, and the gateway's CPU
(utime + stime from /proc) is divided by the tokens and the requests it relayed. The client
shares the machine: compare rows of one run.

`--baseline REV` runs a second gateway from commit REV's tree (`git archive`) beside this
one, in front of the same engine, rounds interleaved: the table then gives each API's CPU
on both and the ratio, a before/after measured side by side.

    .venv/bin/python scripts/bench_apis.py [--quick] [--route derender] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
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
    tree: str
    """Which gateway: "this" tree, or the baseline commit."""
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


def unpack(rev: str, folder: Path) -> Path:
    """Commit `rev`'s tree, unpacked under `folder` (no checkout of this one changes)."""
    tree = folder / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


async def measure(size: Size, route: str, baseline: str | None = None) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    plan = Plan(tokens=size.tokens, itl_ms=size.itl_ms, ttft_ms=0, requests={}, warmup=0,
                tracing_streams=0, tracing_requests=0, tracing_rounds=0)
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    bodies = _bodies(size.tokens)
    headers = {"Content-Type": "application/json", "onehop-route": route}
    cells: dict[tuple[str, str, int], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="bench_apis_") as tmp:
        folder = Path(tmp)
        trees = {"this": ROOT} | ({baseline: unpack(baseline, folder)} if baseline else {})
        engine = start_engine(tokenizer_dir, engine_port, plan, folder / "engine.log")
        gateways: dict[str, tuple[str, Any]] = {}
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                for index, (tree, root) in enumerate(trees.items()):
                    port = free_port()
                    process = start_gateway(tokenizer_dir, engine_url, port, folder, name=f"gateway{index}", root=root)
                    gateways[tree] = (f"http://127.0.0.1:{port}", process)
                    await wait_ready(session, gateways[tree][0], process, folder / f"gateway{index}.log")
                for round_index, measured in enumerate([False] + [True] * size.rounds):
                    order = list(gateways.items())[:: 1 if round_index % 2 else -1]  # neither always first
                    for streams in CONCURRENCY:
                        for api in APIS:
                            for tree, (url, process) in order:
                                path, body = bodies[api]
                                key = (tree, api, streams)
                                cell = cells.setdefault(key, Cell(tree, api, streams)) if measured else Cell(*key)
                                count = size.requests if measured else streams
                                await run_cell(session, url + path, body, headers, cell, count, process.pid, size.tokens)
                    print(f"{'measured' if measured else 'warmed'}", file=sys.stderr)
        finally:
            for _, process in gateways.values():
                stop(process)
            stop(engine)
    return {"size": asdict(size), "route": route, "baseline": baseline, "rows": [_row(cell) for cell in cells.values()]}


def _row(cell: Cell) -> dict[str, Any]:
    return {
        "tree": cell.tree,
        "api": cell.api,
        "streams": cell.streams,
        "requests": cell.requests,
        "events_per_request": cell.events / cell.requests,
        "cpu_us_per_token": cell.cpu_s / cell.tokens * 1e6,
        "cpu_ms_per_request": cell.cpu_s / cell.requests * 1e3,
    }


def report(results: dict[str, Any]) -> str:
    size = results["size"]
    head = (
        f"route {results['route']}, {size['tokens']} tokens per answer at {size['itl_ms']} ms, "
        f"{size['requests']} requests x {size['rounds']} rounds per cell"
    )
    rows = results["rows"]
    if results.get("baseline"):
        return head + "\n" + _compared(rows, results["baseline"])
    lines = [
        head,
        "| API | streams | events/request | gateway CPU µs/token | gateway CPU ms/request | × chat |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    chat = {row["streams"]: row["cpu_us_per_token"] for row in rows if row["api"] == "chat"}
    for row in sorted(rows, key=lambda r: (r["streams"], APIS.index(r["api"]))):
        ratio = row["cpu_us_per_token"] / chat[row["streams"]] if chat.get(row["streams"]) else float("nan")
        lines.append(
            f"| {row['api']} | {row['streams']} | {row['events_per_request']:.0f} | {row['cpu_us_per_token']:.1f} "
            f"| {row['cpu_ms_per_request']:.2f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def _ratio(top: float, bottom: float) -> str:
    """A ratio of two CPU figures; a short run may measure none (the clock's tick is 10 ms)."""
    return f"{top / bottom:.2f}" if bottom else "n/a"


def _compared(rows: list[dict[str, Any]], baseline: str) -> str:
    """Each API and concurrency on both gateways: CPU per token, and the baseline's over this one's."""
    cpu = {(row["tree"], row["api"], row["streams"]): row["cpu_us_per_token"] for row in rows}
    chat = {(tree, streams): cpu[tree, "chat", streams] for tree, _, streams in cpu}
    lines = [
        f"| API | streams | baseline {baseline} µs/token (× its chat) | this tree µs/token (× its chat) | baseline / this |",
        "|---|---:|---:|---:|---:|",
    ]
    for streams in CONCURRENCY:
        for api in APIS:
            before, after = cpu[baseline, api, streams], cpu["this", api, streams]
            lines.append(
                f"| {api} | {streams} | {before:.1f} ({_ratio(before, chat[baseline, streams])}) "
                f"| {after:.1f} ({_ratio(after, chat['this', streams])}) | {_ratio(before, after)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer, shorter answers)")
    parser.add_argument("--route", default="derender", choices=("derender", "text", "tokens"))
    parser.add_argument("--baseline", default=None, help="a commit whose gateway runs beside this one")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(QUICK if args.quick else FULL, args.route, args.baseline))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
