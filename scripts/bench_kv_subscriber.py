"""The KV event subscriber's CPU in a listening gateway process, per stored block and per batch.

A publisher child process (this script with `--publish`; its CPU is not counted) stands for a
sim engine with prefix caching: the engine's own `PrefixCache` (blocks of 16 tokens, chained
hashes, least recently used evicted first) and `KVEventPublisher` (a ZMQ PUB and a replay
ROUTER on loopback, vLLM's wire). Each batch is one prefill's events: a prompt of 50 to 100
new blocks, half of them a conversation's next turn (chained on its earlier turns, which are
hits and not stored again), the rest fresh; once the cache holds its budget, the batch also
carries the removals that keep it there.

Gateways: `python -m gateway` processes (`--workers 1`), each in `kv_cache` mode with one
engine (a closed port: health checks fail the same way in each) that has `kv_events`:

- `events`: subscribed to the publisher;
- `silent`: subscribed to a second PUB of the publisher that never sends: the same process,
  idle without events.

With `--baseline REV` a second such pair runs commit REV's tree (`git archive`) beside them,
on the same publisher, so every batch reaches both trees' `events` gateways.

Per index size (10,000, 100,000 and 1,000,000 blocks; `--quick`: 10,000 and 100,000) the
publisher first fills its cache to that size as fast as it can (not measured; the index
follows it), then sends `--batches` batches at `--rate` a second. The gateways' budget
(`balancing.kv_index.max_blocks`) is the largest size: at that size the index is at its
budget, each batch's stores past it and its removals back within. Over that window each
gateway's CPU (utime + stime from /proc) is read; the window ends when every `events`
gateway's metrics count every stored event sent. The subscriber's cost is the `events`
gateway's CPU less its tree's `silent` gateway's, per stored block and per batch. The
index's size (its gauge) is read at the window's end.

The publisher, the gateways and this script share the machine: compare rows of one run.

    .venv/bin/python scripts/bench_kv_subscriber.py [--quick] [--baseline REV] [--batches N]
        [--rate PER_S] [--sizes N,N,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    BenchError,
    client_session,
    free_port,
    process_cpu,
    start_gateway,
    stop,
    wait_ready,
)

from engine.backends.sim.kv_publisher import KVEventPublisher  # noqa: E402
from engine.backends.sim.prefix_cache import PrefixCache  # noqa: E402
from engine.config import KVEventsConfig  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from plumbing.http_server import new_event_loop  # noqa: E402
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

BLOCK = 16
TOPIC = "kv"
VOCABULARY = 1 << 16
"""Token ids drawn below this (two random bytes each)."""
NEW_BLOCKS = (50, 100)
"""New blocks a prefill stores, fewest and most."""
FILL_BLOCKS = 64
"""Blocks a fill batch stores: fresh prompts, one a batch."""
CONVERSATIONS = 64
"""Conversations whose next turn a batch may be."""
LONGEST_BLOCKS = 512
"""A conversation this long starts over (a fresh prompt)."""
CATCH_UP_S = 120.0
"""Longest wait for the gateways to count what was sent."""


@dataclass(frozen=True)
class Size:
    sizes: tuple[int, ...]
    batches: int
    rate: float


FULL = Size(sizes=(10_000, 100_000, 1_000_000), batches=1000, rate=100.0)
QUICK = Size(sizes=(10_000, 100_000), batches=300, rate=100.0)


# ------------------------------------------------------------ the publisher (a child process)


@dataclass
class Sent:
    """What the publisher sent since it started."""

    batches: int = 0
    stored_events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0


class Engine:
    """A sim engine's prefix cache and event publisher, driven by prompts of random tokens."""

    def __init__(self, seed: int) -> None:
        self.cache = PrefixCache(BLOCK, capacity=1)
        self.sent = Sent()
        self.events = KVEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
            topic=TOPIC,
        ))
        self.silent = KVEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
            topic=TOPIC,
        ))
        self._random = random.Random(seed)
        self._conversations: list[list[int]] = []

    def _tokens(self, blocks: int) -> list[int]:
        return array("H", self._random.randbytes(2 * blocks * BLOCK)).tolist()

    def prefill(self, new_blocks: int, *, turn: bool) -> None:
        """One prompt's prefill: a conversation's next turn (`turn`) or a fresh prompt."""
        ids = self._tokens(new_blocks)
        if turn and self._conversations:
            at = self._random.randrange(len(self._conversations))
            earlier = self._conversations[at]
            ids = earlier + ids if len(earlier) // BLOCK + new_blocks <= LONGEST_BLOCKS else ids
            self._conversations[at] = ids
        elif len(self._conversations) < CONVERSATIONS:
            self._conversations.append(ids)
        else:
            self._conversations[self._random.randrange(CONVERSATIONS)] = ids
        events = self.cache.store(self.cache.lookup(ids))
        self.sent.batches += 1
        for event in events:
            if isinstance(event, BlockStored):
                self.sent.stored_events += 1
                self.sent.stored_blocks += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.sent.removed_blocks += len(event.block_hashes)
        self.events.publish(events)

    async def fill(self, blocks: int) -> None:
        """Fresh prompts until the cache holds `blocks`, its budget from then on."""
        self.cache.capacity = blocks
        while len(self.cache) < blocks:
            self.prefill(min(FILL_BLOCKS, blocks - len(self.cache)), turn=False)
            await asyncio.sleep(0)  # the publisher sends each pass's events as one batch

    async def run(self, batches: int, rate: float) -> float:
        """`batches` prefills at `rate` a second, half of them conversations' next turns; the wall time."""
        start = time.monotonic()
        for i in range(batches):
            self.prefill(self._random.randint(*NEW_BLOCKS), turn=self._random.random() < 0.5)
            await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.monotonic()))
        return time.monotonic() - start


async def publish(seed: int) -> None:
    """Answer one JSON command a line on stdin with one JSON line on stdout, until stdin ends."""
    engine = Engine(seed)
    await engine.events.start()
    await engine.silent.start()
    loop = asyncio.get_running_loop()
    _answer({"events": engine.events.endpoint, "events_replay": engine.events.replay_endpoint,
             "silent": engine.silent.endpoint, "silent_replay": engine.silent.replay_endpoint})
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            wall = 0.0
            if command["op"] == "clear":
                engine.events.publish([AllBlocksCleared()])
                await asyncio.sleep(0)
            elif command["op"] == "fill":
                await engine.fill(command["blocks"])
            elif command["op"] == "run":
                wall = await engine.run(command["batches"], command["rate"])
            _answer(asdict(engine.sent) | {"wall_s": wall, "cache_blocks": len(engine.cache)})
    finally:
        await engine.events.close()
        await engine.silent.close()


def _answer(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


class Publisher:
    """The parent's side of the publisher child."""

    def __init__(self, log: Path, seed: int) -> None:
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--publish", "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT, start_new_session=True,
        )
        self.endpoints: dict[str, str] = {}
        self.last: dict[str, Any] = {}
        """The publisher's last reply."""

    async def read(self) -> dict[str, Any]:
        stdout: IO[bytes] | None = self.process.stdout
        assert stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, stdout.readline)
        if not line:
            raise BenchError(f"the publisher exited with {self.process.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def start(self) -> None:
        self.endpoints = await self.read()

    async def command(self, op: str, **args: Any) -> Sent:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write((json.dumps({"op": op} | args) + "\n").encode())
        stdin.flush()
        reply = await self.read()
        self.last = reply
        return Sent(reply["batches"], reply["stored_events"], reply["stored_blocks"], reply["removed_blocks"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


# ------------------------------------------------------------ gateways


@dataclass
class Gateway:
    tree: str
    role: str
    """`events` or `silent`."""
    url: str
    process: subprocess.Popen[bytes]


@dataclass
class Row:
    size: int
    tree: str
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    events_cpu_s: float = 0.0
    silent_cpu_s: float = 0.0
    index_blocks: float = 0.0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def us_per_block(self) -> float:
        return (self.events_cpu_s - self.silent_cpu_s) / self.stored_blocks * 1e6

    @property
    def us_per_batch(self) -> float:
        return (self.events_cpu_s - self.silent_cpu_s) / self.batches * 1e6


def gateway_extra(engine_url: str, events: str, replay: str, max_blocks: int) -> dict[str, Any]:
    member = {"url": engine_url, "kv_events": events, "kv_replay": replay, "kv_topic": TOPIC}
    return {"engines": [member], "balancing": {"mode": "kv_cache", "kv_index": {"max_blocks": max_blocks}}}


async def scrape(session: aiohttp.ClientSession, gateway: Gateway) -> dict[str, float]:
    """The gateway's KV event counts by type, and its index's size (`index_blocks`)."""
    async with session.get(gateway.url + "/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_kv_events":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    found[sample.labels["type"]] = found.get(sample.labels["type"], 0.0) + sample.value
        elif family.name == "onehop_gateway_kv_index_blocks":
            found["index_blocks"] = family.samples[0].value
    return found


async def caught_up(session: aiohttp.ClientSession, gateways: Sequence[Gateway], key: str, count: int) -> list[dict[str, float]]:
    """Wait until each `events` gateway counts `count` events of type `key`; every gateway is
    scraped as often (the scrapes' CPU is the same in each)."""
    deadline = time.monotonic() + CATCH_UP_S
    while True:
        counts = [await scrape(session, gateway) for gateway in gateways]
        if all(c.get(key, 0) >= count for c, g in zip(counts, gateways, strict=True) if g.role == "events"):
            return counts
        if time.monotonic() > deadline:
            raise BenchError(f"the gateways counted {[c.get(key, 0) for c in counts]} {key} events of {count}")
        await asyncio.sleep(0.1)


async def join(session: aiohttp.ClientSession, publisher: Publisher, gateways: Sequence[Gateway]) -> None:
    """An AllBlocksCleared until each `events` gateway has heard one (a PUB drops what it sends
    before a subscription reaches it)."""
    deadline = time.monotonic() + CATCH_UP_S
    while True:
        await publisher.command("clear")
        await asyncio.sleep(0.2)
        counts = [await scrape(session, g) for g in gateways if g.role == "events"]
        if all(c.get("AllBlocksCleared", 0) >= 1 for c in counts):
            return
        if time.monotonic() > deadline:
            raise BenchError("the gateways never heard the publisher")


def unpack(rev: str, folder: Path) -> Path:
    """Commit `rev`'s tree, unpacked under `folder` (no checkout of this one changes)."""
    tree = folder / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


async def measure(size: Size, baseline: str | None, seed: int) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    engine_url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the same failed health checks in each
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench_kv_subscriber_") as tmp:
        folder = Path(tmp)
        trees = {"this": ROOT} | ({baseline: unpack(baseline, folder)} if baseline else {})
        publisher = Publisher(folder / "publisher.log", seed)
        gateways: list[Gateway] = []
        try:
            await publisher.start()
            ends = publisher.endpoints
            for tree, root in trees.items():
                for role in ("events", "silent"):
                    port = free_port()
                    name = f"gateway-{len(gateways)}"
                    extra = gateway_extra(engine_url, ends[role], ends[f"{role}_replay"], max(size.sizes))
                    process = start_gateway(tokenizer_dir, engine_url, port, folder, name=name, extra=extra, root=root)
                    gateways.append(Gateway(tree, role, f"http://127.0.0.1:{port}", process))
            async with client_session() as session:
                for i, gateway in enumerate(gateways):
                    await wait_ready(session, gateway.url, gateway.process, folder / f"gateway-{i}.log")
                await join(session, publisher, gateways)
                for blocks in size.sizes:
                    sent = await publisher.command("fill", blocks=blocks)
                    await caught_up(session, gateways, "BlockStored", sent.stored_events)
                    print(f"filled {blocks} blocks", file=sys.stderr)
                    rows += await window(session, publisher, gateways, size, blocks)
        finally:
            for gateway in gateways:
                stop(gateway.process)
            publisher.close()
    return {"commit": _commit(), "machine": _machine(), "size": asdict(size), "seed": seed, "baseline": baseline,
            "rows": [asdict(row) | {"us_per_stored_block": row.us_per_block, "us_per_batch": row.us_per_batch}
                     for row in rows]}


async def window(
    session: aiohttp.ClientSession, publisher: Publisher, gateways: Sequence[Gateway], size: Size, blocks: int
) -> list[Row]:
    """`size.batches` paced batches; each tree's row."""
    before = await publisher.command("run", batches=0, rate=size.rate)
    cpu = [process_cpu(g.process.pid) for g in gateways]
    after = await publisher.command("run", batches=size.batches, rate=size.rate)
    counts = await caught_up(session, gateways, "BlockStored", after.stored_events)
    used = [process_cpu(g.process.pid) - c for g, c in zip(gateways, cpu, strict=True)]
    rows: dict[str, Row] = {}
    for gateway, cpu_s, count in zip(gateways, used, counts, strict=True):
        row = rows.setdefault(gateway.tree, Row(
            blocks, gateway.tree, after.batches - before.batches, after.stored_blocks - before.stored_blocks,
            after.removed_blocks - before.removed_blocks, wall_s=publisher.last["wall_s"],
        ))
        if gateway.role == "events":
            row.events_cpu_s, row.index_blocks = cpu_s, count.get("index_blocks", 0.0)
        else:
            row.silent_cpu_s = cpu_s
    for row in rows.values():
        print(f"{row.size} {row.tree}: {row.us_per_block:.2f} µs/block", file=sys.stderr)
    return list(rows.values())


def _commit() -> str:
    """HEAD's short hash, `+` when the tree has changes not committed."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True)
    return (done.stdout.strip() or "unknown") + ("+" if changed.stdout.strip() else "")


def _machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


# ------------------------------------------------------------ report


def report(results: dict[str, Any]) -> str:
    size, machine = results["size"], results["machine"]
    lines = [
        f"commit {results['commit']}" + (f", baseline {results['baseline']}" if results["baseline"] else "")
        + f"; {machine['cpu']} ({machine['cores']} cores), Python {machine['python']}",
        f"{size['batches']} batches a window at {size['rate']:.0f}/s, {NEW_BLOCKS[0]}-{NEW_BLOCKS[1]} new blocks a "
        f"batch of {BLOCK} tokens",
        "| index blocks | tree | batches | stored | removed | events gateway CPU s | silent gateway CPU s "
        "| µs / stored block | µs / batch |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['index_blocks']:,.0f} | {row['tree']} | {row['batches']} | {row['stored_blocks']:,} "
            f"| {row['removed_blocks']:,} | {row['events_cpu_s']:.2f} | {row['silent_cpu_s']:.2f} "
            f"| {row['us_per_stored_block']:.2f} | {row['us_per_batch']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="index sizes to 100,000 blocks, shorter windows")
    parser.add_argument("--baseline", default=None, help="a commit whose gateways run beside this tree's")
    parser.add_argument("--batches", type=int, default=None, help="batches a window")
    parser.add_argument("--rate", type=float, default=None, help="batches a second")
    parser.add_argument("--sizes", default=None, help="index sizes in blocks, comma-separated")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    parser.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(publish(args.seed))
        return 0
    size = QUICK if args.quick else FULL
    size = Size(
        sizes=tuple(int(s) for s in args.sizes.split(",")) if args.sizes else size.sizes,
        batches=args.batches or size.batches,
        rate=args.rate or size.rate,
    )
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(size, args.baseline, args.seed))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
