"""Time to first token under a burst: N streams started at once, through onehop and the routers.

Side by side in one run, bursts interleaved (the order turned every round), in
front of the same scripted producer (`scripts/bench_relay.py --upstream`: a
chat stream for the routers and the engine's generate API for onehop, same
cadence, same code):

- `direct`: the producer itself, the TTFT every relay is measured against;
- `vllm-router` and `smg` (from the routers' venv, made by `bench_relay.py`'s
  setup on first use);
- onehop's gateway, one worker, on the `derender` route (bytes relayed) and
  optionally the `text` route; with `--baseline REV` (repeatable), a gateway
  from commit REV's tree (`git archive`) beside this tree's;
- with `--sim`, onehop in front of the sim engine too, against the engine's
  own derender stream as its direct.

A burst is N requests issued in the same loop turn from a client whose
connections are kept alive between bursts (a client of a gateway is usually
a pool of them); each request's TTFT runs from its own issue to its first
output-bearing event. Per setup and N: TTFT p50 and p99 added over the direct
stream's p50 and p99 of the same run. The client shares the machine with
everything measured: compare the rows of one run, not runs.

    .venv/bin/python scripts/bench_burst.py [--quick] [--no-routers] [--baseline REV] [--sim] [--workers N]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from scripts.bench_apis import unpack  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    BenchError,
    Plan,
    Requests,
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
from scripts.bench_relay import (  # noqa: E402
    ROUTERS,
    engine_file,
    ensure_routers,
    spawn_command,
    start_router,
    wait_serving,
)

from plumbing.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402

RELAY_SCRIPT = ROOT / "scripts" / "bench_relay.py"
OPENAI = "/v1/chat/completions"


@dataclass(frozen=True)
class Size:
    tokens: int
    itl_ms: float
    bursts: dict[int, int]
    """Bursts per setup and size (after one unmeasured)."""


FULL = Size(tokens=50, itl_ms=20, bursts={1: 20, 32: 8, 128: 6, 256: 3})
QUICK = Size(tokens=10, itl_ms=20, bursts={1: 10, 32: 3, 128: 2, 256: 1})
"""50 tokens a second a stream, as a served model streams: at 2 ms a token, 128 streams are 64,000
chunks a second, which the client in this process cannot read as they come (its own delay then
counts as every relay's TTFT)."""


@dataclass
class Setup:
    name: str
    url: str
    body: Callable[[], bytes]
    """A body per request (the engine's direct requests need their own request ids)."""
    headers: dict[str, str]
    direct: str
    """The setup whose TTFT this one's is measured against."""
    pid: int | None
    """The relaying process (its tree's CPU is measured); None: a direct stream."""


@dataclass
class Cell:
    setup: str
    streams: int
    ttft_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


async def burst(session: aiohttp.ClientSession, setup: Setup, cell: Cell | None, streams: int, tokens: int) -> None:
    """`streams` requests issued at once; each one's TTFT, and the relay's CPU, recorded in
    `cell` (None: a warm-up)."""
    before = tree_cpu(setup.pid) if setup.pid is not None else 0.0
    samples = await asyncio.gather(*(stream_once(session, setup.url, setup.body(), setup.headers) for _ in range(streams)))
    for sample in samples:
        if sample.completion_tokens != tokens:
            raise BenchError(f"{setup.name}: {sample.completion_tokens} tokens, not {tokens}")
    if cell is not None:
        cell.ttft_s.extend(sample.ttft_s for sample in samples)
        if setup.pid is not None:
            cell.cpu_s += tree_cpu(setup.pid) - before


async def measure(
    size: Size, *, routers: bool, baselines: tuple[str, ...], sim: bool, routes: tuple[str, ...],
    workers: tuple[int, ...] = (1,),
) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    binaries = ensure_routers() if routers else None
    plan = Plan(tokens=size.tokens, itl_ms=size.itl_ms, ttft_ms=0, requests={}, warmup=0,
                tracing_streams=0, tracing_requests=0, tracing_rounds=0)
    cells: dict[tuple[str, int], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="bench_burst_") as tmp:
        folder = Path(tmp)
        trees: dict[str, Path] = {"this": ROOT}
        for index, rev in enumerate(baselines):
            (folder / f"tree{index}").mkdir()
            trees[rev] = unpack(rev, folder / f"tree{index}")
        procs: dict[str, subprocess.Popen[bytes]] = {}
        port = {name: free_port() for name in ("engine", "upstream", *ROUTERS)}
        url = {name: f"http://127.0.0.1:{p}" for name, p in port.items()}
        try:
            async with client_session() as session:
                procs["engine"] = start_engine(tokenizer_dir, port["engine"], plan, folder / "engine.log")
                await wait_ready(session, url["engine"], procs["engine"], folder / "engine.log")
                stand_in = await engine_file(session, url["engine"], tokenizer_dir, folder)
                procs["upstream"] = spawn_command(
                    [sys.executable, str(RELAY_SCRIPT), "--upstream", str(port["upstream"]), "--tokens", str(size.tokens),
                     "--itl-ms", str(size.itl_ms), "--engine-file", str(stand_in)], folder / "upstream.log")
                await wait_serving(session, url["upstream"], procs["upstream"], folder / "upstream.log")
                producers = {"scripted": url["upstream"]} | ({"sim": url["engine"]} if sim else {})
                gateways: dict[tuple[str, str], tuple[str, int]] = {}
                for index, ((tree, root), (producer, producer_url), count) in enumerate(
                    (t, p, w) for t in trees.items() for p in producers.items() for w in workers
                ):
                    name = f"gateway{index}"
                    gateway_port = free_port()
                    procs[name] = start_gateway(
                        tokenizer_dir, producer_url, gateway_port, folder, name=name, root=root, workers=count
                    )
                    label = tree if count == 1 else f"{tree}, {count} workers"
                    gateways[label, producer] = (f"http://127.0.0.1:{gateway_port}", procs[name].pid)
                    await wait_ready(session, gateways[label, producer][0], procs[name], folder / f"{name}.log")
                if binaries is not None:
                    for name in ROUTERS:
                        procs[name] = start_router(name, binaries, port[name], url["upstream"], folder)
                        await wait_serving(session, url[name], procs[name], folder / f"{name}.log")
                pids = {name: procs[name].pid for name in ROUTERS if name in procs}
                setups = _setups(tokenizer_dir, url, gateways, pids, size.tokens, routes)
                for streams, count in size.bursts.items():
                    for round_index in range(count + 1):
                        order = list(setups.values())[:: 1 if round_index % 2 else -1]  # neither end always first
                        for setup in order:
                            cell = cells.setdefault((setup.name, streams), Cell(setup.name, streams)) if round_index else None
                            await burst(session, setup, cell, streams, size.tokens)
                    print(f"x{streams}: {count} bursts", file=sys.stderr)
        finally:
            for process in procs.values():
                stop(process)
    return {"size": asdict(size), "baselines": list(baselines), "rows": _rows(cells, setups)}


def _setups(
    tokenizer_dir: Path, url: dict[str, str], gateways: dict[tuple[str, str], tuple[str, int]],
    routers: dict[str, int], tokens: int, routes: tuple[str, ...],
) -> dict[str, Setup]:
    requests = Requests(tokenizer_dir, url["engine"], url["engine"], tokens)
    json_headers = {"Content-Type": "application/json"}

    def chat() -> bytes:
        return requests.chat

    def direct() -> bytes:
        return requests.body("direct")

    scripted = "direct: scripted"
    setups = {scripted: Setup(scripted, url["upstream"] + OPENAI, chat, json_headers, scripted, None)}
    if any(producer == "sim" for _, producer in gateways):
        setups["direct: sim"] = Setup("direct: sim", requests.url("direct"), direct, requests.headers("direct"), "direct: sim", None)
    for name, pid in routers.items():
        setups[name] = Setup(name, url[name] + OPENAI, chat, json_headers, scripted, pid)
    for (tree, producer), (gateway_url, pid) in gateways.items():
        for route in routes:
            name = f"onehop {route} ({tree}): {producer}"
            setups[name] = Setup(name, gateway_url + OPENAI, chat, requests.headers(route), f"direct: {producer}", pid)
    return setups


def _rows(cells: dict[tuple[str, int], Cell], setups: dict[str, Setup]) -> list[dict[str, Any]]:
    rows = []
    for (name, streams), cell in cells.items():
        base = cells[setups[name].direct, streams]
        p50, p99 = percentile(cell.ttft_s, 50), percentile(cell.ttft_s, 99)
        rows.append({
            "setup": name, "streams": streams, "samples": len(cell.ttft_s),
            "ttft_p50_ms": p50 * 1e3, "ttft_p99_ms": p99 * 1e3,
            "added_p50_ms": (p50 - percentile(base.ttft_s, 50)) * 1e3,
            "added_p99_ms": (p99 - percentile(base.ttft_s, 99)) * 1e3,
            "cpu_ms_per_stream": cell.cpu_s / len(cell.ttft_s) * 1e3 if setups[name].pid is not None else None,
        })
    return rows


def report(results: dict[str, Any]) -> str:
    size = results["size"]
    lines = [
        f"{size['tokens']}-chunk streams at {size['itl_ms']} ms per token; bursts per size: {size['bursts']}",
        "| setup: producer | streams at once | TTFT p50 | TTFT p99 | p50 added | p99 added | relay CPU per stream |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results["rows"], key=lambda r: (r["streams"], not r["setup"].startswith("direct"), r["setup"])):
        lines.append(
            f"| {r['setup']} | {r['streams']} | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms"
            f" | {r['added_p50_ms']:+.1f} ms | {r['added_p99_ms']:+.1f} ms | {_cpu(r['cpu_ms_per_stream'])} |"
        )
    return "\n".join(lines)


def _cpu(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--no-routers", action="store_true", help="onehop only (no router install)")
    parser.add_argument("--baseline", action="append", default=[], help="a commit whose gateway runs beside this one (repeatable)")
    parser.add_argument("--sim", action="store_true", help="onehop in front of the sim engine too")
    parser.add_argument("--route", action="append", default=None, choices=("derender", "text", "tokens"),
                        help="onehop's routes to measure (repeatable; default derender)")
    parser.add_argument("--streams", type=int, action="append", default=None, help="only these burst sizes")
    parser.add_argument("--bursts", type=int, default=None, help="bursts per setup and size (default: the size's)")
    parser.add_argument("--workers", type=int, action="append", default=None,
                        help="onehop gateways with this many workers (repeatable; default 1)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.streams or args.bursts:
        sizes = args.streams or list(size.bursts)
        size = Size(size.tokens, size.itl_ms, {n: args.bursts or size.bursts.get(n, 2) for n in sizes})
    started = time.monotonic()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(size, routers=not args.no_routers, baselines=tuple(args.baseline), sim=args.sim,
                                     routes=tuple(args.route or ("derender",)), workers=tuple(args.workers or (1,))))
    results["wall_s"] = time.monotonic() - started
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
