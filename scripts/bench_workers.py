"""Gateway throughput with `--workers 1` against `--workers 2`, at 128 concurrent streams.

Starts one sim engine (`onehop engine --backend sim`, auto mode, N content
tokens per answer) and two gateways in front of it: one process, and a
supervisor with two workers sharing a port. Rounds alternate between them
(1, 2, 1, 2, ...) after one unmeasured warm-up round each; in a round 128
clients stream the same chat request back to back (closed loop) on the chosen
route, each on its own connections. Reported per gateway and route: completed
streams per second, SSE events per second, p50/p99 TTFT and E2E, and the
gateway's CPU (the process tree: supervisor and workers) per event.

Everything shares this machine's cores, the engine and this client included:
compare the two gateways of one run, not runs.

    .venv/bin/python scripts/bench_workers.py [--quick] [--routes derender,text]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from scripts.bench_gateway import (  # noqa: E402
    Plan,
    Requests,
    client_session,
    free_port,
    percentile,
    process_cpu,
    start_engine,
    start_gateway,
    stop,
    stream_once,
    wait_ready,
)

from plumbing.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

STREAMS = 128


@dataclass(frozen=True)
class Size:
    tokens: int
    requests: int
    """Streams per measured round (each of the 128 clients makes about requests/128)."""
    rounds: int


FULL = Size(tokens=200, requests=512, rounds=3)
QUICK = Size(tokens=50, requests=128, rounds=1)


@dataclass
class Totals:
    streams: int = 0
    events: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


def tree_cpu(pid: int) -> float:
    """utime + stime of a process and all its descendants that are alive."""
    total = process_cpu(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it exited meanwhile
                total += tree_cpu(int(child))
    return total


async def one_round(session, requests: Requests, route: str, count: int, pid: int, totals: Totals | None) -> None:
    issued = iter(range(count))
    url, body, headers = requests.url(route), requests.body(route), requests.headers(route)

    async def client() -> None:
        for _ in issued:
            sample = await stream_once(session, url, body, headers)
            if totals is not None:
                totals.streams += 1
                totals.events += sample.events
                totals.ttft_s.append(sample.ttft_s)
                totals.e2e_s.append(sample.e2e_s)

    cpu = tree_cpu(pid)
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(STREAMS)))
    if totals is not None:
        totals.wall_s += time.perf_counter() - start
        totals.cpu_s += tree_cpu(pid) - cpu


async def measure(size: Size, routes: list[str]) -> dict[tuple[int, str], Totals]:
    tokenizer_dir = ensure_tokenizer()
    plan = Plan(tokens=size.tokens, itl_ms=2, ttft_ms=5, requests={}, warmup=0,
                tracing_streams=0, tracing_requests=0, tracing_rounds=0)
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    results: dict[tuple[int, str], Totals] = {}
    with tempfile.TemporaryDirectory(prefix="bench_workers_") as tmp:
        folder = Path(tmp)
        engine = start_engine(tokenizer_dir, engine_port, plan, folder / "engine.log")
        gateways = {}
        try:
            for workers in (1, 2):
                port = free_port()
                process = start_gateway(tokenizer_dir, engine_url, port, folder, name=f"gateway{workers}", workers=workers)
                gateways[workers] = (f"http://127.0.0.1:{port}", process)
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                for workers, (url, process) in gateways.items():
                    await wait_ready(session, url, process, folder / f"gateway{workers}.log")
                base = Requests(tokenizer_dir, engine_url, gateways[1][0], size.tokens)
                for measured in [False] + [True] * size.rounds:
                    for route in routes:
                        for workers, (url, process) in gateways.items():
                            totals = results.setdefault((workers, route), Totals()) if measured else None
                            count = size.requests if measured else STREAMS
                            await one_round(session, base.through(url), route, count, process.pid, totals)
                            print(f"{'measured' if measured else 'warmed'} {route} with {workers} worker(s)", file=sys.stderr)
        finally:
            for _, process in gateways.values():
                stop(process)
            stop(engine)
    return results


def report(results: dict[tuple[int, str], Totals], size: Size) -> str:
    lines = [
        f"{STREAMS} concurrent streams, {size.tokens} tokens each, {size.rounds} rounds x {size.requests} streams, "
        f"{os.cpu_count()} CPUs",
        "| route | workers | streams/s | events/s | vs 1 worker | p50 TTFT | p99 TTFT | p50 E2E | gateway CPU per event |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (workers, route), t in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        rate = t.streams / t.wall_s
        single = results[(1, route)]
        lines.append(
            f"| {route} | {workers} | {rate:.1f} | {t.events / t.wall_s:,.0f} | {rate / (single.streams / single.wall_s):.2f}x"
            f" | {percentile(t.ttft_s, 50) * 1e3:.0f} ms | {percentile(t.ttft_s, 99) * 1e3:.0f} ms"
            f" | {percentile(t.e2e_s, 50) * 1e3:.0f} ms | {t.cpu_s / t.events * 1e6:.1f} µs |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--routes", default="derender,text", help="comma-separated routes (derender, text, tokens)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    loop = new_event_loop()
    try:
        results = loop.run_until_complete(measure(size, args.routes.split(",")))
    finally:
        loop.close()
    print(report(results, size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
