"""The gateway's balancing modes side by side in front of four sim engines with prefix caches.

Four `onehop engine --backend sim` processes (two with `--quick`), each with prefix caching on (blocks of 16
tokens, `cache_blocks` too few for any workload's blocks to fit in one engine: the full run's
3,072 a engine, 12,288 in all, just hold the agentic workload's ~11,000 distinct blocks when
each engine keeps its own share of the sessions, as routing by cache does and spreading
does not), prefill time per uncached prompt token (`prefill_us_per_token`, 100 µs: about
10,000 tokens a second, a GPU's order for a mid-size model; an engine prefills one prompt at a time,
so a queue behind it shows in TTFT), a fixed answer length and inter-token
delay, and vLLM's KV cache events on ZMQ ports of their own. One gateway process per mode,
all four started at once and kept for the run:

- `least_outstanding` (power of two choices) and `prefix_affinity` (the prompt's first 256
  tokens hashed), not subscribed to the events;
- `kv_cache`, subscribed to every engine's events and replay socket, without a session key,
  and `kv_cache+session`, the same with each conversation's id sent as `X-Session-ID`.

Three workloads, generated from a seed (`--quick` scales them down): `agentic` (many
sessions interleaved, a few requests in flight, each a shared system prompt and tool list
plus a history growing by a user message and an answer, or a tool call and its result, a
turn), `mixed` (short independent chats, most opening with one of a few system prompts of
Zipf-like popularity) and `no_reuse` (each request a fresh random prompt). Every gateway
first serves a few unmeasured requests of prompts of their own (connections, lazy start-up
work). Each round runs every workload through every mode, modes in an order rotated each
round; before each run every engine's cache is reset (`POST /reset_prefix_cache`) and the
kv gateways are seen to have heard the reset, so every mode starts cold with the same
prompts, in the same order, at the same concurrency. A conversation's next turn is sent
once its previous one ended.

Per workload and mode: the prefix-cache hit rate (the answers' `cached_tokens` over their
`prompt_tokens`), TTFT p50/p99 (to the streamed chat's first event with output: content, or a
tool call where the sim answers one), E2E p50,
throughput (requests over the runs' wall time) and the gateway process's CPU per request
(utime + stime from /proc). The `oracle` row is the hit rate perfect routing with unbounded
caches could reach: each prompt rendered in process exactly as the gateway renders it (its
`LocalRenderer`, same tokenizer; no endpoint returns rendered ids), counting per request
the leading full blocks some earlier request's prompt shares (capped, as the engine does, one
block short of a prompt of whole blocks) over all prompt tokens. Rendered lengths are
checked against the answers' `prompt_tokens`.

The kv gateways' subscriber cost, two ways: in process, the event batches the engines
published during the kv_cache runs (recorded by this script's own SUB sockets) decoded and
applied to a fresh `KVIndex`, timed per stored block (decode + apply, and apply alone);
and in the gateway processes, the CPU of the two idle kv gateways while the unsubscribed
modes ran, less the idle unsubscribed gateway's, per block stored in those windows. The
index's memory: tracemalloc over a `KVIndex` filled with synthetic chains of blocks, one
million in the full run, 100,000 scaled ×10 with `--quick`.

The client, the engines and the gateways share this machine: compare rows of one run.

    .venv/bin/python scripts/bench_routing.py [--quick] [--rounds N] [--seed S] [--cache-blocks N]
        [--prefill-us US] [--agentic-concurrency N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    MODEL,
    BenchError,
    client_session,
    free_port,
    percentile,
    process_cpu,
    spawn,
    start_gateway,
    stop,
    wait_ready,
)

from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from gateway.render.local import LocalRenderer  # noqa: E402
from gateway.render.token_ids import TokenIds  # noqa: E402
from gateway.routing.kv_index import KVIndex, block_keys  # noqa: E402
from plumbing.http_server import new_event_loop  # noqa: E402
from wire.kv_events import AllBlocksCleared, BlockStored, EventBatch, decode_batch  # noqa: E402
from wire.openai_schema import CHAT_COMPLETION_REQUEST_DECODER, ChatCompletionRequest  # noqa: E402

BLOCK = 16
ENGINES = 4
TOPIC = "kv"
MODES = ("least_outstanding", "prefix_affinity", "kv_cache", "kv_cache+session")
KV_MODES = ("kv_cache", "kv_cache+session")
WORKLOADS = ("agentic", "mixed", "no_reuse")
JOIN_TIMEOUT_S = 60.0

HIT_TARGET = 0.95
"""kv_cache's hit rate over the oracle's, on agentic."""
TTFT_TARGET = 3.0
"""least_outstanding's TTFT p50 over kv_cache's, on agentic."""
FLOOR_SAMPLES = 24
"""Requests of a workload sent alone to measure its TTFT floor's fixed part (`ttft_floor`)."""
THROUGHPUT_TARGET = 0.03
"""kv_cache's throughput at most this share below least_outstanding's, on no_reuse (routing by
cache must cost nothing where there is nothing to reuse; faster is not a miss)."""


@dataclass(frozen=True)
class Size:
    sessions: int
    turns: tuple[int, int]
    system_words: int
    tool_words: int
    append_words: tuple[int, int]
    agentic_concurrency: int
    chats: int
    chat_systems: int
    chat_system_words: tuple[int, int]
    chat_words: tuple[int, int]
    chat_concurrency: int
    fresh: int
    fresh_words: tuple[int, int]
    fresh_concurrency: int
    engines: int
    """Sim engines in front of which the modes run (four; two in the quick run, to bound its memory)."""
    cache_blocks: int
    """Per engine."""
    prefill_us_per_token: float
    itl_ms: float
    ttft_ms: float
    output_tokens: int
    rounds: int
    index_blocks: int
    """Blocks in the memory measurement's index."""
    index_scale: int
    """What its figure is multiplied by, to stand for a million blocks."""


FULL = Size(
    sessions=24, turns=(10, 40), system_words=2000, tool_words=900, append_words=(120, 360), agentic_concurrency=6,
    chats=160, chat_systems=8, chat_system_words=(400, 2000), chat_words=(40, 250), chat_concurrency=8,
    fresh=200, fresh_words=(800, 2400), fresh_concurrency=8,
    engines=4, cache_blocks=3072, prefill_us_per_token=100, itl_ms=2, ttft_ms=2, output_tokens=16, rounds=3,
    index_blocks=1_000_000, index_scale=1,
)
QUICK = Size(
    sessions=8, turns=(3, 7), system_words=600, tool_words=300, append_words=(60, 160), agentic_concurrency=4,
    chats=24, chat_systems=4, chat_system_words=(200, 600), chat_words=(20, 100), chat_concurrency=4,
    fresh=12, fresh_words=(300, 800), fresh_concurrency=4,
    engines=2, cache_blocks=320, prefill_us_per_token=20, itl_ms=2, ttft_ms=2, output_tokens=8, rounds=1,
    index_blocks=100_000, index_scale=10,
)


# ------------------------------------------------------------ workloads

_VOCABULARY = (
    "river stone harbour lantern market garden engine signal window ledger copper meadow bridge tower "
    "canal orchard beacon anchor compass furnace quarry thread needle barrel cellar attic kettle basket "
    "ladder saddle wagon harvest winter summer autumn spring morning evening silver golden quiet rapid "
    "narrow broad ancient modern distant nearby hollow steady gentle bitter sweet salty amber crimson "
    "violet olive marble granite cedar willow maple birch falcon heron otter badger beaver rabbit "
    "sparrow raven whistle murmur thunder drizzle breeze shadow glimmer ember ash smoke vapor crystal "
    "parse render token buffer socket thread queue cache block index shard replica cluster gateway route "
    "request answer stream header payload schema record column table query commit branch merge review "
    "deploy rollback metric trace span budget quota limit timeout retry backoff circuit breaker health "
    "check probe config option flag value default override patch module package import export function "
    "method class object field property return yield await async loop event handler callback promise"
)
_WORDS = _VOCABULARY.split()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def span(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


@dataclass
class Request:
    conversation: str
    body: dict[str, Any]
    after: int | None
    """The position of the conversation's previous turn in the workload (sent once it ended)."""


def _chat_body(messages: list[dict[str, Any]], size: Size, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [dict(message) for message in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": size.output_tokens,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if tools:
        body["tools"] = tools
    return body


def _tools(rng: random.Random, total_words: int) -> list[dict[str, Any]]:
    count = 8
    tools = []
    for i in range(count):
        name = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{i}"
        properties = {
            f"{rng.choice(_WORDS)}_{j}": {"type": "string", "description": words(rng, 6)} for j in range(3)
        }
        tools.append({"type": "function", "function": {
            "name": name, "description": words(rng, max(total_words // count - 30, 5)),
            "parameters": {"type": "object", "properties": properties, "required": list(properties)[:1]},
        }})
    return tools


def _interleave(rng: random.Random, lengths: Sequence[int], stagger: bool) -> list[tuple[int, int]]:
    """(conversation, turn) in send order: conversations picked at random, weighted by the
    turns they have left (so they end together); `stagger` opens them a few at a time."""
    left = list(lengths)
    opened = len(lengths) if not stagger else min(4, len(lengths))
    order: list[tuple[int, int]] = []
    while any(left):
        live = [i for i in range(opened) if left[i]]
        if not live or (opened < len(lengths) and rng.random() < 0.25):
            opened += 1
            continue
        pick = rng.choices(live, weights=[left[i] for i in live])[0]
        order.append((pick, lengths[pick] - left[pick]))
        left[pick] -= 1
    return order


def _ordered(conversations: list[list[dict[str, Any]]], order: list[tuple[int, int]], prefix: str) -> list[Request]:
    last: dict[int, int] = {}
    requests = []
    for position, (conversation, turn) in enumerate(order):
        requests.append(Request(f"{prefix}-{conversation}", conversations[conversation][turn], last.get(conversation)))
        last[conversation] = position
    return requests


def agentic(size: Size, seed: int) -> list[Request]:
    rng = random.Random(f"agentic {seed}")
    system = {"role": "system", "content": "You are a coding agent. " + words(rng, size.system_words)}
    tools = _tools(rng, size.tool_words)
    conversations: list[list[dict[str, Any]]] = []
    for s in range(size.sessions):
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": f"Task {s}: " + words(rng, 60)}]
        bodies = []
        for turn in range(span(rng, size.turns)):
            if turn:
                if rng.random() < 0.5:
                    call_id = f"call_{s}_{turn}"
                    tool = rng.choice(tools)["function"]
                    arguments = json.dumps({"target": words(rng, 4)})
                    messages.append({"role": "assistant", "content": "", "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": tool["name"], "arguments": arguments}}]})
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": words(rng, span(rng, size.append_words))})
                else:
                    messages.append({"role": "assistant", "content": words(rng, span(rng, size.append_words))})
                    messages.append({"role": "user", "content": words(rng, rng.randint(15, 60))})
            bodies.append(_chat_body(messages, size, tools))
        conversations.append(bodies)
    order = _interleave(rng, [len(c) for c in conversations], stagger=False)
    return _ordered(conversations, order, "agent")


def mixed(size: Size, seed: int) -> list[Request]:
    rng = random.Random(f"mixed {seed}")
    systems = [words(rng, span(rng, size.chat_system_words)) for _ in range(size.chat_systems)]
    popularity = [1 / (rank + 1) ** 1.1 for rank in range(size.chat_systems)]
    conversations: list[list[dict[str, Any]]] = []
    for _ in range(size.chats):
        if rng.random() < 0.85:
            system = rng.choices(systems, weights=popularity)[0]
        else:  # a one-off system prompt
            system = words(rng, span(rng, size.chat_system_words))
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        bodies = []
        for turn in range(rng.randint(1, 3)):
            if turn:
                messages.append({"role": "assistant", "content": words(rng, span(rng, size.chat_words))})
            messages.append({"role": "user", "content": words(rng, span(rng, size.chat_words))})
            bodies.append(_chat_body(messages, size))
        conversations.append(bodies)
    order = _interleave(rng, [len(c) for c in conversations], stagger=True)
    return _ordered(conversations, order, "chat")


def no_reuse(size: Size, seed: int) -> list[Request]:
    rng = random.Random(f"fresh {seed}")
    conversations = [
        [_chat_body([{"role": "user", "content": f"{rng.getrandbits(64):x} " + words(rng, span(rng, size.fresh_words))}], size)]
        for _ in range(size.fresh)
    ]
    return _ordered(conversations, [(i, 0) for i in range(size.fresh)], "fresh")


def workloads(size: Size, seed: int) -> dict[str, tuple[list[Request], int]]:
    """Each workload's requests and its concurrency (requests in flight at most)."""
    return {
        "agentic": (agentic(size, seed), size.agentic_concurrency),
        "mixed": (mixed(size, seed), size.chat_concurrency),
        "no_reuse": (no_reuse(size, seed), size.fresh_concurrency),
    }


# ------------------------------------------------------------ the oracle


def rendered(tokenizer_dir: Path, requests: Sequence[Request]) -> list[TokenIds]:
    """Each request's prompt ids as the gateway renders them (its own renderer, in process)."""
    renderer = LocalRenderer(tokenizer_dir)
    try:
        prompts = []
        for request in requests:
            decoded = CHAT_COMPLETION_REQUEST_DECODER.decode(msgspec.json.encode(request.body))
            assert isinstance(decoded, ChatCompletionRequest)
            prompts.append(renderer.chat_sync(decoded))
        return prompts
    finally:
        renderer.close()


def oracle(prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Leading full blocks each prompt shares with any earlier one (one block short of a
    prompt of whole blocks at most: its last token is always computed), over all tokens."""
    seen: set[int] = set()
    hits = total = 0
    uncached: list[int] = []
    for ids in prompts:
        keys = block_keys(ids, BLOCK)
        most = min(len(keys), (len(ids) - 1) // BLOCK)
        run = 0
        while run < most and keys[run] in seen:
            run += 1
        hits += run * BLOCK
        total += len(ids)
        uncached.append(len(ids) - run * BLOCK)
        seen.update(keys)
    return {"hit_rate": hits / total, "prompt_tokens": total, "distinct_blocks": len(seen), "uncached": uncached}


async def ttft_floor(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[Request],
    bodies: Sequence[bytes],
    uncached: Sequence[int],
    size: Size,
) -> dict[str, Any]:
    """The lowest TTFT p50 any routing could reach on a workload: each request with only the
    oracle's uncached tokens to prefill (unbounded caches, every earlier prompt's blocks on
    the engine it goes to) and nothing queued ahead of it, plus the time from a prefill's end
    to the first output the client sees (the engine's fixed `ttft_ms`, the steps before a tool
    call's name can be parsed, the gateway and the network). That last part is measured: a
    sample of the workload's requests, each sent twice in a row alone through `url` (the
    second finds all but its last block cached), less its own prefill."""
    sample = list(range(0, len(requests), max(1, len(requests) // FLOOR_SAMPLES)))
    fixed_s: list[float] = []
    headers = {"Content-Type": "application/json"}
    for position in sample:
        await stream_chat(session, url + "/v1/chat/completions", bodies[position], headers)
        again = await stream_chat(session, url + "/v1/chat/completions", bodies[position], headers)
        own_prefill_s = (again.prompt_tokens - again.cached_tokens) * size.prefill_us_per_token / 1e6
        fixed_s.append(again.ttft_s - own_prefill_s)
    fixed = percentile(fixed_s, 50)
    floors = [tokens * size.prefill_us_per_token / 1e6 + fixed for tokens in uncached]
    return {"fixed_ms": fixed * 1000, "sampled": len(sample), "ttft_p50_ms": percentile(floors, 50) * 1000}


# ------------------------------------------------------------ client


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[msgspec.Raw] | None = None

    def output(self) -> bool:
        """Whether this delta carries any of the answer (the sim may answer a request with
        tools by calling one)."""
        return bool(self.content or self.reasoning or self.reasoning_content or self.tool_calls)


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: msgspec.Raw | None = None


_CHUNK = msgspec.json.Decoder(_Chunk)


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int


async def stream_chat(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> Answer:
    """One streamed chat: TTFT at the first event with output (content, reasoning or a tool
    call), E2E at the stream's end."""
    start = time.perf_counter()
    first: float | None = None
    usage: _Usage | None = None
    last = b""
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise BenchError(f"{url} answered {response.status}: {(await response.text())[:500]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            last = line
            chunk = _CHUNK.decode(line[6:])
            if chunk.error is not None:
                raise BenchError(f"an in-band error: {bytes(chunk.error)[:500]!r}")
            if first is None and any(c.delta is not None and c.delta.output() for c in chunk.choices):
                first = time.perf_counter()
            usage = chunk.usage or usage
    end = time.perf_counter()
    if first is None or usage is None:
        raise BenchError(f"{url}: a stream without output or usage (its last event: {last[:300]!r})")
    details = usage.prompt_tokens_details
    if details is None or details.cached_tokens is None:
        raise BenchError(f"{url}: usage without cached_tokens")
    return Answer(first - start, end - start, usage.prompt_tokens, details.cached_tokens)


async def run_workload(
    session: aiohttp.ClientSession, url: str, requests: Sequence[Request], bodies: Sequence[bytes], concurrency: int,
    with_session: bool,
) -> tuple[list[Answer], float]:
    """Every request, `concurrency` at most in flight, each turn after its conversation's
    previous one; the answers in workload order and the wall time."""
    done = [asyncio.Event() for _ in requests]
    answers: list[Answer | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def worker() -> None:
        for position in queue:
            request = requests[position]
            if request.after is not None:
                await done[request.after].wait()
            headers = {"Content-Type": "application/json"}
            if with_session:
                headers["X-Session-ID"] = request.conversation
            answers[position] = await stream_chat(session, url + "/v1/chat/completions", bodies[position], headers)
            done[position].set()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return [answer for answer in answers if answer is not None], wall


# ------------------------------------------------------------ processes


@dataclass
class Engine:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    events: str = ""
    """Its KV events' PUB and replay endpoints, as its capabilities document names them."""
    replay: str = ""


def start_engine(tokenizer_dir: Path, size: Size, folder: Path, index: int) -> Engine:
    """Events on loopback ports the OS picks (a port 0 is bound; a named host and port would
    be connected to, as vLLM does), read back from the capabilities once it is up."""
    port = free_port()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0", "topic": TOPIC,
    }
    options = {
        "mode": "auto", "output_tokens": size.output_tokens, "itl_ms": size.itl_ms, "ttft_ms": size.ttft_ms,
        "cache_blocks": size.cache_blocks, "prefill_us_per_token": size.prefill_us_per_token,
    }
    args = [
        "engine", "--backend", "sim", "--model", str(tokenizer_dir), "--served-model-name", MODEL, "--port", str(port),
        "--enable-prefix-caching", "--block-size", str(BLOCK), "--kv-events-config", json.dumps(config),
    ]
    for key, value in options.items():
        args += ["--backend-option", f"{key}={json.dumps(value)}"]
    log = folder / f"engine{index}.log"
    return Engine(f"http://127.0.0.1:{port}", spawn(args, log), log)


async def engine_ready(session: aiohttp.ClientSession, engine: Engine) -> None:
    await wait_ready(session, engine.url, engine.process, engine.log)
    async with session.get(engine.url + "/inference/v1/capabilities") as response:
        events = (await response.json())["kv_events"]
    engine.events, engine.replay = events["endpoint"], events["replay_endpoint"]


def gateway_extra(mode: str, engines: Sequence[Engine]) -> dict[str, Any]:
    subscribed = mode in KV_MODES
    members = [
        {"url": e.url, "kv_events": e.events, "kv_replay": e.replay, "kv_topic": TOPIC} if subscribed else {"url": e.url}
        for e in engines
    ]
    return {"engines": members, "balancing": {"mode": "kv_cache" if subscribed else mode}}


async def cleared_counts(session: aiohttp.ClientSession, gateway: str) -> dict[str, float]:
    """AllBlocksCleared events the gateway has received, per engine (its metrics)."""
    async with session.get(gateway + "/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_kv_events":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("type") == "AllBlocksCleared":
                    counts[sample.labels["engine"]] = sample.value
    return counts


async def reset_caches(session: aiohttp.ClientSession, engines: Sequence[Engine], kv_gateways: Sequence[str]) -> None:
    """Empty every engine's cache, until every kv gateway has heard each reset (a PUB drops
    what it sends before a subscription reaches it, so at the start a reset may go unheard)."""
    before = [await cleared_counts(session, gateway) for gateway in kv_gateways]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    pending = list(engines)
    while pending:
        for engine in pending:
            async with session.post(engine.url + "/reset_prefix_cache") as response:
                if response.status != 200:
                    raise BenchError(f"{engine.url} refused the reset: {response.status}")
        for _ in range(10):
            await asyncio.sleep(0.05)
            now = [await cleared_counts(session, gateway) for gateway in kv_gateways]
            pending = [
                e for e in engines
                if any(after.get(e.url, 0) <= was.get(e.url, 0) for was, after in zip(before, now, strict=True))
            ]
            if not pending:
                return
        if time.monotonic() > deadline:
            raise BenchError(f"the kv gateways never heard {[e.url for e in pending]}'s resets")


class Recorder:
    """This script's own SUB socket on each engine's events: the payloads of chosen windows."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self._context = zmq.asyncio.Context()
        self._sockets = []
        for engine in engines:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
            sock.setsockopt(zmq.RCVHWM, 1_000_000)
            sock.connect(engine.events)
            self._sockets.append(sock)
        self.window: list[tuple[int, bytes]] | None = None
        self._tasks = [asyncio.create_task(self._read(i, sock)) for i, sock in enumerate(self._sockets)]

    async def _read(self, engine: int, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if self.window is not None:
                self.window.append((engine, frames[2]))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._context.destroy(linger=0)


def stored_blocks(window: Sequence[tuple[int, bytes]]) -> int:
    return sum(
        len(event.block_hashes)
        for _, payload in window
        for event in decode_batch(payload).events
        if isinstance(event, BlockStored)
    )


# ------------------------------------------------------------ measuring


@dataclass
class Cell:
    workload: str
    mode: str
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    walls_s: list[float] = field(default_factory=list)
    """Each round's wall time."""
    gateway_cpu_s: float = 0.0
    length_mismatches: int = 0


@dataclass
class Idle:
    """The idle gateways' CPU while an unsubscribed mode ran, and the blocks stored meanwhile."""

    kv_cpu_s: float = 0.0
    """The two kv gateways', summed."""
    plain_cpu_s: float = 0.0
    """The idle unsubscribed gateway's, doubled (one for each kv gateway)."""
    blocks: int = 0
    batches: int = 0


async def measure(size: Size, seed: int) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    loads = workloads(size, seed)
    bodies = {name: [msgspec.json.encode(r.body) for r in requests] for name, (requests, _) in loads.items()}
    prompts = {name: rendered(tokenizer_dir, requests) for name, (requests, _) in loads.items()}
    oracles = {name: oracle(ids) for name, ids in prompts.items()}
    print(f"workloads: {[(name, len(r)) for name, (r, _) in loads.items()]}", file=sys.stderr)
    cells = {(w, m): Cell(w, m) for w in WORKLOADS for m in MODES}
    idle = Idle()
    recorded: list[list[tuple[int, bytes]]] = []
    floors: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmp:
        folder = Path(tmp)
        engines = [start_engine(tokenizer_dir, size, folder, i) for i in range(size.engines)]
        gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        recorder: Recorder | None = None
        try:
            async with client_session() as session:
                for engine in engines:
                    await engine_ready(session, engine)
                for i, mode in enumerate(MODES):
                    port = free_port()
                    name = f"gateway{i}"
                    process = start_gateway(tokenizer_dir, engines[0].url, port, folder, name=name,
                                            extra=gateway_extra(mode, engines))
                    gateways[mode] = (f"http://127.0.0.1:{port}", process)
                for mode, (url, process) in gateways.items():
                    await wait_ready(session, url, process, folder / f"gateway{MODES.index(mode)}.log")
                recorder = Recorder(engines)
                kv_urls = [gateways[mode][0] for mode in KV_MODES]
                await warm_up(session, size, seed, [url for url, _ in gateways.values()])
                for round_index in range(size.rounds):
                    order = MODES[round_index % len(MODES):] + MODES[: round_index % len(MODES)]
                    for workload in WORKLOADS:
                        requests, concurrency = loads[workload]
                        for mode in order:
                            await reset_caches(session, engines, kv_urls)
                            url, process = gateways[mode]
                            window: list[tuple[int, bytes]] = []
                            recorder.window = window
                            cpu = {m: process_cpu(p.pid) for m, (_, p) in gateways.items()}
                            answers, wall = await run_workload(
                                session, url, requests, bodies[workload], concurrency, mode == "kv_cache+session")
                            used = {m: process_cpu(p.pid) - cpu[m] for m, (_, p) in gateways.items()}
                            recorder.window = None
                            cell = cells[workload, mode]
                            _add(cell, answers, prompts[workload], wall, used[mode])
                            if mode == "kv_cache":
                                recorded.append(window)
                            else:  # the kv gateways idle, subscribed; the other unsubscribed one idle, not
                                other = next(m for m in MODES if m not in KV_MODES and m != mode)
                                idle.kv_cpu_s += sum(used[m] for m in KV_MODES)
                                idle.plain_cpu_s += 2 * used[other]
                                idle.blocks += 2 * stored_blocks(window)
                                idle.batches += 2 * len(window)
                            print(f"round {round_index} {workload} {mode}: {len(answers)} in {wall:.1f} s, "
                                  f"hit {cell.cached_tokens / max(cell.prompt_tokens, 1):.3f}", file=sys.stderr)
                for workload in WORKLOADS:
                    requests, _ = loads[workload]
                    await reset_caches(session, engines, kv_urls)
                    floors[workload] = await ttft_floor(
                        session, gateways["kv_cache"][0], requests, bodies[workload], oracles[workload]["uncached"], size)
        finally:
            if recorder is not None:
                await recorder.close()
            for _, process in gateways.values():
                stop(process)
            for engine in engines:
                stop(engine.process)
    results: dict[str, Any] = {
        "commit": _commit(),
        "machine": _machine(),
        "size": asdict(size),
        "seed": seed,
        "workloads": {
            w: {"oracle": _without(oracles[w], "uncached"), "floor": floors[w], "requests": len(loads[w][0]),
                "concurrency": loads[w][1],
                "rows": [_row(cells[w, m]) for m in MODES] + [_oracle_row(oracles[w], floors[w])]}
            for w in WORKLOADS
        },
        "subscriber": {
            "recorded": replay_cost(recorded, len(engines)),
            "process": _idle_cost(idle),
            "index_memory": index_memory(size.index_blocks, size.index_scale),
        },
    }
    results["targets"] = targets(results)
    return results


async def warm_up(session: aiohttp.ClientSession, size: Size, seed: int, gateways: Sequence[str]) -> None:
    """Unmeasured requests through each gateway (its connections, lazy start-up work), prompts
    of their own (the caches are reset before every measured run anyway)."""
    requests = no_reuse(size, seed + 1)[: 2 * size.fresh_concurrency]
    bodies = [msgspec.json.encode(request.body) for request in requests]
    for url in gateways:
        await run_workload(session, url, requests, bodies, size.fresh_concurrency, False)


def _add(cell: Cell, answers: Sequence[Answer], prompts: Sequence[Sequence[int]], wall: float, cpu: float) -> None:
    for answer, ids in zip(answers, prompts, strict=True):
        cell.ttft_s.append(answer.ttft_s)
        cell.e2e_s.append(answer.e2e_s)
        cell.prompt_tokens += answer.prompt_tokens
        cell.cached_tokens += answer.cached_tokens
        cell.length_mismatches += answer.prompt_tokens != len(ids)
    cell.walls_s.append(wall)
    cell.gateway_cpu_s += cpu


def _row(cell: Cell) -> dict[str, Any]:
    requests = len(cell.e2e_s)
    return {
        "mode": cell.mode,
        "requests": requests,
        "hit_rate": cell.cached_tokens / cell.prompt_tokens,
        "ttft_p50_ms": percentile(cell.ttft_s, 50) * 1000,
        "ttft_p99_ms": percentile(cell.ttft_s, 99) * 1000,
        "e2e_p50_ms": percentile(cell.e2e_s, 50) * 1000,
        "throughput_rps": requests / sum(cell.walls_s),
        "round_wall_s": cell.walls_s,
        "gateway_cpu_ms_per_request": cell.gateway_cpu_s / requests * 1000,
        "prompt_length_mismatches": cell.length_mismatches,
    }


def _without(found: dict[str, Any], key: str) -> dict[str, Any]:
    return {name: value for name, value in found.items() if name != key}


def _oracle_row(found: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """The oracle's hit rate, and as its TTFT p50 the floor (`ttft_floor`): no routing gets below it."""
    return {"mode": "oracle", "requests": None, "hit_rate": found["hit_rate"], "ttft_p50_ms": floor["ttft_p50_ms"],
            "ttft_p99_ms": None,
            "e2e_p50_ms": None, "throughput_rps": None, "round_wall_s": None, "gateway_cpu_ms_per_request": None,
            "prompt_length_mismatches": None}


def replay_cost(windows: Sequence[Sequence[tuple[int, bytes]]], engines: int) -> dict[str, Any]:
    """The recorded batches through a fresh index per window, as the subscriber applies them."""
    names = [f"http://engine-{i}" for i in range(engines)]
    decode_s = apply_s = 0.0
    stored = removed = batches = 0
    for window in windows:
        start = time.perf_counter()
        decoded: list[tuple[int, EventBatch]] = [(engine, decode_batch(payload)) for engine, payload in window]
        decode_s += time.perf_counter() - start
        index = KVIndex(BLOCK)
        start = time.perf_counter()
        for engine, batch in decoded:
            index.apply(names[engine], batch.events)
        apply_s += time.perf_counter() - start
        batches += len(decoded)
        for _, batch in decoded:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored += len(event.block_hashes)
                elif not isinstance(event, AllBlocksCleared):
                    removed += len(event.block_hashes)
    per_block = 1e6 / stored if stored else float("nan")
    return {
        "batches": batches, "blocks_stored": stored, "blocks_removed": removed,
        "apply_us_per_stored_block": apply_s * per_block, "decode_apply_us_per_stored_block": (decode_s + apply_s) * per_block,
    }


def _idle_cost(idle: Idle) -> dict[str, Any]:
    extra = idle.kv_cpu_s - idle.plain_cpu_s
    return {
        "blocks_stored": idle.blocks, "batches": idle.batches, "kv_gateways_cpu_s": idle.kv_cpu_s,
        "idle_baseline_cpu_s": idle.plain_cpu_s,
        "us_per_stored_block": extra / idle.blocks * 1e6 if idle.blocks else None,
        "us_per_batch": extra / idle.batches * 1e6 if idle.batches else None,
    }


def _synthetic(blocks: int) -> Iterator[tuple[str, list[BlockStored]]]:
    """Chains of 64 blocks of distinct tokens, round-robin over four engines."""
    chain = 64
    token = 0
    for start in range(0, blocks, chain):
        count = min(chain, blocks - start)
        ids = list(range(token, token + count * BLOCK))
        token += count * BLOCK
        hashes: list[int | bytes] = list(range(start + 1, start + count + 1))
        event = BlockStored(block_hashes=hashes, token_ids=ids, block_size=BLOCK, medium="GPU")
        yield f"http://engine-{(start // chain) % ENGINES}", [event]


def index_memory(blocks: int, scale: int) -> dict[str, Any]:
    """tracemalloc's count of what an index of `blocks` blocks holds, ×`scale`; and the fill's time."""
    gc.collect()
    index = KVIndex(BLOCK, max_blocks=blocks)
    start = time.perf_counter()
    for engine, events in _synthetic(blocks):
        index.apply(engine, events)
    fill_s = time.perf_counter() - start
    del index
    gc.collect()
    tracemalloc.start()
    try:
        index = KVIndex(BLOCK, max_blocks=blocks)
        base = tracemalloc.get_traced_memory()[0]
        for engine, events in _synthetic(blocks):
            index.apply(engine, events)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        assert index.size == blocks
    finally:
        tracemalloc.stop()
    return {
        "blocks_filled": blocks, "scale": scale, "bytes_per_block": held / blocks,
        "mib_per_million_blocks": held / blocks * 1e6 / 2**20,
        "fill_us_per_block": fill_s / blocks * 1e6,
    }


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    def row(workload: str, mode: str) -> dict[str, Any]:
        return next(r for r in results["workloads"][workload]["rows"] if r["mode"] == mode)

    found = []
    for mode in KV_MODES:
        hit = row("agentic", mode)["hit_rate"] / results["workloads"]["agentic"]["oracle"]["hit_rate"]
        found.append({"name": f"agentic: {mode} hit rate / oracle", "value": hit, "target": f">= {HIT_TARGET}",
                      "met": hit >= HIT_TARGET})
        ttft = row("agentic", "least_outstanding")["ttft_p50_ms"] / row("agentic", mode)["ttft_p50_ms"]
        found.append({"name": f"agentic: least_outstanding TTFT p50 / {mode} TTFT p50", "value": ttft,
                      "target": f">= {TTFT_TARGET}", "met": ttft >= TTFT_TARGET})
        rate = row("no_reuse", mode)["throughput_rps"] / row("no_reuse", "least_outstanding")["throughput_rps"]
        found.append({"name": f"no_reuse: {mode} throughput / least_outstanding throughput", "value": rate,
                      "target": f">= {1 - THROUGHPUT_TARGET:g} (at most {THROUGHPUT_TARGET:.0%} slower)",
                      "met": rate >= 1 - THROUGHPUT_TARGET})
    floor = results["workloads"]["agentic"]["floor"]["ttft_p50_ms"]
    reachable = row("agentic", "least_outstanding")["ttft_p50_ms"] / floor
    found.append({"name": "agentic: least_outstanding TTFT p50 / the floor's (the most any routing could reach)",
                  "value": reachable, "target": f">= {TTFT_TARGET} for the TTFT target to be reachable",
                  "met": reachable >= TTFT_TARGET})
    return found


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def _machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count()}


# ------------------------------------------------------------ report


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def report(results: dict[str, Any]) -> str:
    size = results["size"]
    machine = results["machine"]
    lines = [
        f"commit {results['commit']}, {machine['cpu']} ({machine['cores']} cores); {size['engines']} sim engines, "
        f"{size['cache_blocks']} blocks of {BLOCK} tokens each, prefill {size['prefill_us_per_token']:g} µs per "
        f"uncached token, {size['output_tokens']} tokens at {size['itl_ms']:g} ms; {size['rounds']} round(s)",
    ]
    for workload in WORKLOADS:
        found = results["workloads"][workload]
        o = found["oracle"]
        lines += [
            "",
            f"### {workload}: {found['requests']} requests, {found['concurrency']} in flight at most, "
            f"{o['prompt_tokens']} prompt tokens, {o['distinct_blocks']} distinct blocks",
            "",
            "| mode | hit rate | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | requests/s | gateway CPU ms/request |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in found["rows"]:
            lines.append(
                f"| {row['mode']} | {row['hit_rate']:.3f} | {_num(row['ttft_p50_ms'])} | {_num(row['ttft_p99_ms'])} "
                f"| {_num(row['e2e_p50_ms'])} | {_num(row['throughput_rps'], 2)} | {_num(row['gateway_cpu_ms_per_request'], 2)} |"
            )
        floor = found["floor"]
        lines.append(
            f"\noracle TTFT p50: the floor (no routing gets below it): each request's oracle-uncached tokens at "
            f"{size['prefill_us_per_token']:g} µs, nothing queued, plus {floor['fixed_ms']:.1f} ms from a prefill's end to "
            f"the first output (median of {floor['sampled']} requests sent alone)"
        )
        mismatches = sum(row["prompt_length_mismatches"] or 0 for row in found["rows"])
        if mismatches:
            lines.append(f"\n{mismatches} answers' prompt_tokens differ from the oracle's rendering")
    sub = results["subscriber"]
    recorded, process, memory = sub["recorded"], sub["process"], sub["index_memory"]
    scaled = "" if memory["scale"] == 1 else f", ×{memory['scale']}"
    lines += [
        "",
        "### kv gateways' subscriber",
        "",
        f"- in process, the kv_cache runs' {recorded['batches']} recorded batches ({recorded['blocks_stored']} blocks "
        f"stored, {recorded['blocks_removed']} removed): apply {recorded['apply_us_per_stored_block']:.2f} µs, "
        f"decode + apply {recorded['decode_apply_us_per_stored_block']:.2f} µs per stored block",
        f"- gateway processes, idle and subscribed while unsubscribed modes ran: "
        f"{_num(process['us_per_stored_block'], 2)} µs CPU per stored block, {_num(process['us_per_batch'], 0)} µs "
        f"per batch ({process['blocks_stored']} blocks in {process['batches']} batches, summed over both kv gateways; "
        f"{process['kv_gateways_cpu_s']:.2f} s less an idle baseline of {process['idle_baseline_cpu_s']:.2f} s; "
        f"the clock ticks every 10 ms)",
        f"- index memory (tracemalloc, {memory['blocks_filled']} synthetic blocks"
        f"{scaled}): {memory['bytes_per_block']:.0f} bytes a block, "
        f"{memory['mib_per_million_blocks']:.0f} MiB per million blocks; filled at {memory['fill_us_per_block']:.2f} µs a block",
        "",
        "### targets",
        "",
    ]
    for target in results["targets"]:
        lines.append(f"- {target['name']}: {target['value']:.3f} (target {target['target']}): "
                     f"{'met' if target['met'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workloads, one round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every workload through every mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-blocks", type=int, default=None, help="each engine's prefix cache, in blocks")
    parser.add_argument("--prefill-us", type=float, default=None, help="prefill time per uncached prompt token")
    parser.add_argument("--agentic-concurrency", type=int, default=None,
                        help="agentic requests in flight at most (1: the light load where one engine can hoard the sessions)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    changed = {"rounds": args.rounds, "cache_blocks": args.cache_blocks, "prefill_us_per_token": args.prefill_us,
               "agentic_concurrency": args.agentic_concurrency}
    size = Size(**(asdict(size) | {name: value for name, value in changed.items() if value is not None}))
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(measure(size, args.seed))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
