"""Side-by-side benchmark of serving setups: an async OpenAI-API load generator, one table.

Every setup runs in this one invocation, on the same prompts (fixed seeds),
one cell per setup × workload, cells interleaved (for each workload, every
setup in turn, in `--rounds` rounds) so drift on a shared machine hits them
alike:

- C: gateway → engine on the `derender` route (the engine sends OpenAI chunks);
- D: gateway → engine on the `tokens` route (the engine sends ids, the
  gateway derenders statefully);
- E: gateway with the cost policy (configs/policy.yaml: its rules, then
  `default: cost` against the engine's live output CPU).

The engine is `onehop engine --backend sim` (vLLM venv absent or not
requested: sim engine), one engine process and one gateway process per
setup, each in its own process group, started with the helpers of
`scripts/bench_gateway.py` and killed at the end.

Setups on vLLM 0.32 (CPU, the tiny random Qwen3 model of
`engine.qwen3.fixtures.ensure_tiny_model`), run only when `--setups` names
them and a vLLM python is found (`--vllm-python`, else $ONEHOP_VLLM_PYTHON,
else the last line of `bash scripts/setup_vllm.sh`); refused otherwise:

- A: vLLM coupled: `scripts/vllm_serve.sh` (qwen3 reasoning parser, hermes
  tool parser, auto tool choice; the script also passes --enable-scale-out),
  the client posts to its /v1/chat/completions;
- B: vLLM three-stage: onehop gateway with `render: remote`, `route:
  tokens-remote`, `remote_url` a second vLLM server (render + stateless
  derender, tier "remote"), `engines` the vLLM server of A (its
  /inference/v1/generate);
- C-vllm: gateway → `onehop engine --backend vllm` (run with vLLM's python,
  PYTHONPATH the checkout) on the `derender` route;
- D-vllm: the same engine, the `tokens` route;
- E-vllm: the same engine, the cost policy.

vLLM processes are counted as their whole process group (the API server and
its engine-core children). vLLM on CPU is slow: run these on few requests
(`--requests reasoning=8,tools=32,logprobs=32,short=64 --warmup 2
--concurrency 4`). The random model calls no tools, so the `tools` workload's
tool-call check is off for them; and it samples its padding ids (embedding
rows past the tokenizer's vocabulary), which onehop's derender refuses, so
every vLLM setup's requests carry `logit_bias` -100 on those ids (the sim
setups' do not). vLLM's engine processes busy-poll their shared-memory queues
for a second after their last message, on the core the next vLLM engine
computes on; with a vLLM setup in the run every round starts after a
`VLLM_SETTLE_S` pause, so one server's spinning does not slow the next one's
steps.

Workloads (`--workloads`, default all), streamed chat with
`stream_options.include_usage`:

- reasoning: thinking on, long outputs (`max_tokens` 1000, 2000, 3000, 4000 in
  turn; 200 in the quick plan; `ignore_eos`);
- tools: two tools with `tool_choice: auto`, the sim answers with a Hermes
  tool call (every stream must carry tool-call deltas);
- logprobs: `logprobs` with `top_logprobs: 20` (policy E sends these to the
  tokens route by its `wide-logprobs` rule);
- short: short chats, `max_tokens` 32, `ignore_eos`.

Load: closed loop (`--concurrency N` workers back to back) or open loop
(`--rate R`: Poisson arrivals at R requests/s, seeded). Each cell first sends
`warmup` unmeasured requests (in its first round), then the measured ones.
Per request: TTFT (to
the first SSE event carrying content, reasoning or tool-call deltas), ITL
(between consecutive such events), E2E (to the end of the stream), output
tokens from the usage chunk. Per cell: utime + stime from /proc/PID/stat of
the engine, the gateway and this process (the client) over the measured
phase, per 1k output tokens; the engine's own output-processing CPU
(`onehop_engine_output_cpu_seconds_total`) as cores over the phase; output
tokens/s; the routes the gateway reported (`onehop-route` header).

Output: a markdown table on stdout (`--markdown FILE` too), `--json FILE`,
and with matplotlib importable `--plots DIR` (latency CDFs per workload, CPU
per tier per setup); without matplotlib the plots are skipped with a note.
The client shares the machine's cores with the servers: compare rows of one
run, not runs.

    .venv/bin/python scripts/bench.py [--quick] [--setups C,D,E[,A,B,C-vllm,D-vllm,E-vllm]] [--vllm-python PATH]
        [--workloads reasoning,tools,logprobs,short] [--requests N | --requests reasoning=8,short=64]
        [--warmup N] [--rounds N] [--concurrency 16 | --rate 40]
        [--json out.json] [--markdown out.md] [--plots docs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

from plumbing.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer  # noqa: E402
from gateway.routing.feedback import load_between, parse_sample  # noqa: E402
from gateway.routing.policy import load_policy  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    _DATA,
    _DONE,
    MODEL,
    QUICK,
    BenchError,
    _decode,
    _has_output,
    client_session,
    free_port,
    percentile,
    process_cpu,
    spawn,
    start_engine,
    stop,
    wait_ready,
)

POLICY_FILE = ROOT / "configs" / "policy.yaml"
ENGINE_NOTE = "vLLM venv absent or not requested: sim engine"
SEED = 20250101
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "e2e")
TIERS = ("engine", "gateway", "client")

METRICS: tuple[str, ...] = (
    "requests",
    "output_tokens",
    *(f"{name}_p{q}_ms" for name in LATENCIES for q in PERCENTILES),
    "tokens_per_s",
    *(f"{tier}_cpu_s_per_1k_tokens" for tier in TIERS),
    "engine_output_cores",
)
"""Every row's metric columns (JSON keys; the markdown table has one column per metric)."""

HEADERS = {
    "requests": "requests",
    "output_tokens": "output tokens",
    **{f"{name}_p{q}_ms": f"{name.upper()} p{q} (ms)" for name in LATENCIES for q in PERCENTILES},
    "tokens_per_s": "output tok/s",
    **{f"{tier}_cpu_s_per_1k_tokens": f"{tier} CPU s/1k tok" for tier in TIERS},
    "engine_output_cores": "engine output cores",
}


# ------------------------------------------------------------ setups


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    gateway: dict[str, Any]
    """Gateway config keys on top of the common ones (model, tokenizer, engines, host, port)."""
    policy: bool = False
    kind: str = "sim"
    """sim: onehop sim engine; vllm-coupled (A), vllm-three-stage (B), onehop-vllm (C-vllm, D-vllm, E-vllm)."""

    @property
    def vllm(self) -> bool:
        return self.kind != "sim"


SETUPS: dict[str, Setup] = {
    "C": Setup("C", "gateway → engine, derender route", {"route": "derender", "route_header": False}),
    "D": Setup(
        "D",
        "gateway → engine, tokens route (stateful derender in the gateway)",
        {"route": "tokens", "route_header": False},
    ),
    "E": Setup(
        "E",
        "gateway with the cost policy (configs/policy.yaml)",
        {"route": "derender", "route_header": False, "policy": str(POLICY_FILE)},
        policy=True,
    ),
}
"""Setups this script runs, all on the sim engine."""

VLLM_SETUPS: dict[str, Setup] = {
    "A": Setup("A", "vLLM coupled (its own /v1/chat/completions)", {}, kind="vllm-coupled"),
    "B": Setup(
        "B",
        "vLLM three-stage: gateway (render remote, tokens-remote route) → vLLM render/derender + vLLM generate",
        {"render": "remote", "route": "tokens-remote", "route_header": False},
        kind="vllm-three-stage",
    ),
    "C-VLLM": Setup(
        "C-vllm",
        "gateway → onehop engine --backend vllm, derender route",
        {"route": "derender", "route_header": False},
        kind="onehop-vllm",
    ),
    "D-VLLM": Setup(
        "D-vllm",
        "gateway → onehop engine --backend vllm, tokens route (stateful derender in the gateway)",
        {"route": "tokens", "route_header": False},
        kind="onehop-vllm",
    ),
    "E-VLLM": Setup(
        "E-vllm",
        "gateway with the cost policy → onehop engine --backend vllm",
        {"route": "derender", "route_header": False, "policy": str(POLICY_FILE)},
        policy=True,
        kind="onehop-vllm",
    ),
}
"""Setups on vLLM 0.32 (CPU, tiny random model): only with a vLLM python and only when named."""

PLANNED_SETUPS: dict[str, str] = {}
"""Setups of the benchmark plan this script cannot run yet (none)."""

VLLM_NOTE = "vLLM 0.32 on CPU, tiny random Qwen3 model"


def find_vllm_python(explicit: str | None) -> tuple[Path | None, str]:
    """vLLM's venv python: --vllm-python, $ONEHOP_VLLM_PYTHON, else scripts/setup_vllm.sh's last line."""
    if explicit:
        where = f"--vllm-python {explicit}"
        candidate = explicit
    elif os.environ.get("ONEHOP_VLLM_PYTHON"):
        candidate = os.environ["ONEHOP_VLLM_PYTHON"]
        where = f"ONEHOP_VLLM_PYTHON={candidate}"
    else:
        where = "bash scripts/setup_vllm.sh"
        try:
            done = subprocess.run(
                ["bash", str(ROOT / "scripts" / "setup_vllm.sh")],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{where} failed: {exc}"
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            return None, f"{where} exited {done.returncode}: {done.stderr.strip()[-500:]}"
        candidate = lines[-1].strip()
    path = Path(candidate)
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"no executable vLLM python at {path} (from {where})"
    return path, where


def parse_setups(text: str, vllm_python: Callable[[], tuple[Path | None, str]]) -> list[Setup]:
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    if not names:
        raise SystemExit("--setups: name at least one setup")
    available = f"available: {','.join(SETUPS)}, and with a vLLM python {','.join(s.name for s in VLLM_SETUPS.values())}"
    for name in names:
        if name in PLANNED_SETUPS:
            raise SystemExit(
                f"--setups: setup {name} ({PLANNED_SETUPS[name]}) is not available in this script yet; {available}"
            )
        if name not in SETUPS and name not in VLLM_SETUPS:
            raise SystemExit(f"--setups: unknown setup {name!r}; {available}")
    wanted = [name for name in dict.fromkeys(names) if name in VLLM_SETUPS]
    if wanted:
        python, where = vllm_python()
        if python is None:
            raise SystemExit(
                f"--setups: setup(s) {','.join(VLLM_SETUPS[n].name for n in wanted)} need vLLM's python, none"
                f" usable: {where}; pass --vllm-python PATH or set ONEHOP_VLLM_PYTHON; {available}"
            )
    return [SETUPS.get(name) or VLLM_SETUPS[name] for name in dict.fromkeys(names)]


# ------------------------------------------------------------ workloads

TOPICS = (
    "a lighthouse keeper",
    "the tides of a northern harbour",
    "a bakery that opens at 4 am",
    "the last train of the night",
    "a glacier losing its ice",
    "a chess club in a small town",
    "a ship's cat",
    "the first radio in a village",
)
CITIES = ("Lisbon", "Oslo", "Kyoto", "Lima", "Nairobi", "Perth", "Quebec", "Tbilisi")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two cities on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["origin", "destination", "date"],
            },
        },
    },
]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    lengths: tuple[int, ...]
    """`max_tokens` of the full plan's requests, in turn (request i gets lengths[i % len])."""
    quick_max_tokens: int
    messages: Callable[[random.Random], list[dict[str, Any]]]
    extra: dict[str, Any]
    thinking: bool = False
    exact: bool = True
    """`ignore_eos`: every answer is exactly max_tokens long (checked)."""
    tool_calls: bool = False
    """Every stream must carry tool-call deltas."""

    def body(self, rng: random.Random, index: int, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": self.messages(rng),
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "seed": index,
            "chat_template_kwargs": {"enable_thinking": self.thinking},
            **self.extra,
        }
        if self.exact:
            body["ignore_eos"] = True
        return body


def _story(rng: random.Random) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Think it through, then write a long story about {rng.choice(TOPICS)}."}]


def _trip(rng: random.Random) -> list[dict[str, Any]]:
    a, b = rng.sample(CITIES, 2)
    return [
        {"role": "system", "content": "You are a travel assistant. Use the tools when they help."},
        {"role": "user", "content": f"I fly from {a} to {b} on day {rng.randint(1, 28)}: weather and flights?"},
    ]


def _chat(rng: random.Random) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": f"One line about {rng.choice(TOPICS)}, please."},
    ]


# 1k to 4k output tokens; the longest plus a story prompt fits vLLM's 4,096-token context.
REASONING_LENGTHS = (1000, 2000, 3000, 4000)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("reasoning", "thinking on, long outputs (1k-4k tokens)", REASONING_LENGTHS, 200, _story, {}, thinking=True),
        Workload(
            "tools",
            "tools + tool_choice auto, Hermes tool calls",
            (256,),
            128,
            _trip,
            {"tools": TOOLS, "tool_choice": "auto"},
            exact=False,
            tool_calls=True,
        ),
        Workload("logprobs", "logprobs with top_logprobs=20", (256,), 64, _chat, {"logprobs": True, "top_logprobs": 20}),
        Workload("short", "short chats", (32,), 32, _chat, {}),
    )
}


def parse_workloads(text: str) -> list[Workload]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise SystemExit(f"--workloads: unknown {unknown or 'none given'}; available: {','.join(WORKLOADS)}")
    return [WORKLOADS[name] for name in dict.fromkeys(names)]


# ------------------------------------------------------------ plan


@dataclass(frozen=True)
class Plan:
    requests: dict[str, int]
    """Measured requests per cell, by workload."""
    warmup: int
    """Unmeasured requests at the start of every cell (sent concurrently)."""
    concurrency: int
    itl_ms: float
    ttft_ms: float
    quick: bool
    rounds: int = 1
    """Each cell's measured requests run in this many rounds, interleaved across setups."""

    def lengths(self, workload: Workload) -> tuple[int, ...]:
        return (workload.quick_max_tokens,) if self.quick else workload.lengths

    def max_tokens(self, workload: Workload) -> int:
        return max(self.lengths(workload))


FULL = Plan(
    requests={"reasoning": 128, "tools": 512, "logprobs": 192, "short": 1024},
    warmup=8,
    concurrency=16,
    itl_ms=2,
    ttft_ms=20,
    quick=False,
)
QUICK_PLAN = Plan(
    requests={"reasoning": 12, "tools": 32, "logprobs": 16, "short": 32},
    warmup=2,
    concurrency=4,
    itl_ms=1,
    ttft_ms=5,
    quick=True,
)


@dataclass(frozen=True)
class Prompt:
    body: bytes
    max_tokens: int


def prompts(workload: Workload, plan: Plan, count: int) -> list[Prompt]:
    """The same bodies for every setup: a generator seeded by the workload's name."""
    rng = random.Random(SEED ^ zlib.crc32(workload.name.encode()))
    lengths = plan.lengths(workload)
    chosen = [lengths[i % len(lengths)] for i in range(count)]
    return [Prompt(json.dumps(workload.body(rng, i, n)).encode(), n) for i, n in enumerate(chosen)]


# ------------------------------------------------------------ client


@dataclass(frozen=True)
class Result:
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    output_tokens: int
    tool_calls: bool
    route: str


async def stream_chat(session: aiohttp.ClientSession, url: str, body: bytes) -> Result:
    """One streamed chat: timestamps of every output-bearing SSE event, usage from the last chunk."""
    start = time.perf_counter()
    stamps: list[float] = []
    tool_calls = False
    last = b""
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise BenchError(f"{url} answered {resp.status}: {(await resp.text())[:500]}")
        route = resp.headers.get("onehop-route", "?")
        async for line in resp.content:  # to EOF, past [DONE], so the pooled connection is reused
            if not line.startswith(_DATA) or line.startswith(_DONE):
                continue
            last = line
            try:
                chunk = _decode(line)
            except ValueError as exc:  # msgspec.ValidationError: e.g. an in-stream error event
                raise BenchError(f"{url}: an event that is no chunk ({exc}): {line[:500]!r}") from exc
            if _has_output(chunk):
                stamps.append(time.perf_counter())
                tool_calls = tool_calls or b'"tool_calls"' in line
    end = time.perf_counter()
    final = _decode(last) if last else None
    if not stamps or final is None or final.usage is None:
        raise BenchError(f"{url}: a stream without output or usage (last: {last[:300]!r})")
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return Result(stamps[0] - start, itl, end - start, final.usage.completion_tokens, tool_calls, route)


class Progress:
    """One line on stderr, rewritten at most every 0.2 s."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self._shown = label, total, 0, 0.0
        self._tty = sys.stderr.isatty()
        self._clear = "\x1b[K" if self._tty else ""
        self.show(force=True)

    def tick(self) -> None:
        self.done += 1
        self.show(force=self.done == self.total)

    def show(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self._tty and (force or now - self._shown >= 0.2):
            self._shown = now
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total}{self._clear}")
            sys.stderr.flush()

    def end(self, note: str) -> None:
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} {note}{self._clear}\n")
        sys.stderr.flush()


@dataclass
class Cell:
    setup: str
    workload: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    """Summed over the cell's measured phases (its rounds)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    engine_output_cpu_s: float = 0.0
    """The engine's own output-processing CPU over the measured phases (NaN on a vLLM server)."""

    @property
    def engine_output_cores(self) -> float:
        return self.engine_output_cpu_s / self.wall_s if self.wall_s else math.nan


@dataclass
class Proc:
    """A server process in its own process group; `group`: count the whole group's CPU (vLLM)."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path
    group: bool = False

    def cpu(self) -> float:
        return group_cpu(self.popen.pid) if self.group else process_cpu(self.popen.pid)


@dataclass
class Servers:
    setup: Setup
    url: str
    """Where the client posts /v1/chat/completions."""
    tiers: dict[str, Proc]
    """CPU tiers: engine, gateway (absent for A), remote (B's vLLM render/derender server)."""
    metrics_url: str | None
    """A onehop engine's /metrics (output CPU); None on a vLLM server."""


def group_cpu(pgid: int) -> float:
    """utime + stime (and reaped children's) of every process in a process group, in seconds."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


async def engine_sample(session: aiohttp.ClientSession, engine_url: str) -> Any:
    async with session.get(engine_url + "/metrics") as resp:
        return parse_sample(await resp.text(), time.monotonic())


async def run_round(
    session: aiohttp.ClientSession,
    servers: Servers,
    workload: Workload,
    cell: Cell,
    warm: Sequence[Prompt],
    measured: Sequence[Prompt],
    plan: Plan,
    rate: float | None,
) -> None:
    """One round of a cell: `warm` unmeasured (concurrently), then `measured`, added to `cell`."""
    url = servers.url + "/v1/chat/completions"
    # The random-weight model under vLLM calls no tools: the tool-call check is for the sim.
    need_tools = workload.tool_calls and not servers.setup.vllm

    async def one(prompt: Prompt) -> Result:
        result = await stream_chat(session, url, prompt.body)
        if workload.exact and result.output_tokens != prompt.max_tokens:
            raise BenchError(
                f"{cell.setup}/{cell.workload}: {result.output_tokens} output tokens, not {prompt.max_tokens}"
            )
        if need_tools and not result.tool_calls:
            raise BenchError(f"{cell.setup}/{cell.workload}: a stream without tool-call deltas")
        return result

    await asyncio.gather(*(one(prompt) for prompt in warm))
    progress = Progress(f"{cell.setup}/{cell.workload}", len(measured))

    async def measure(prompt: Prompt) -> None:
        cell.results.append(await one(prompt))
        progress.tick()

    client_pid = os.getpid()
    before = {tier: proc.cpu() for tier, proc in servers.tiers.items()}
    before["client"] = process_cpu(client_pid)
    metrics_before = await engine_sample(session, servers.metrics_url) if servers.metrics_url else None
    start = time.perf_counter()
    if rate is None:
        queue = iter(measured)

        async def worker() -> None:
            for prompt in queue:
                await measure(prompt)

        await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    else:
        # Open loop: Poisson arrivals, seeded per workload so every setup gets the same schedule.
        arrivals = random.Random(SEED + zlib.crc32(workload.name.encode()))
        tasks = []
        for prompt in measured:
            tasks.append(asyncio.create_task(measure(prompt)))
            await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*tasks)
    wall_s = time.perf_counter() - start
    cell.wall_s += wall_s
    after = {tier: proc.cpu() for tier, proc in servers.tiers.items()}
    after["client"] = process_cpu(client_pid)
    for tier in after:
        cell.cpu_s[tier] = cell.cpu_s.get(tier, 0.0) + after[tier] - before[tier]
    if metrics_before is not None and servers.metrics_url:
        metrics_after = await engine_sample(session, servers.metrics_url)
        cell.engine_output_cpu_s += load_between(metrics_before, metrics_after).output_cpu_cores * wall_s
    else:
        cell.engine_output_cpu_s = math.nan
    progress.end(f"in {wall_s:.1f} s")


# ------------------------------------------------------------ processes

VLLM_MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
VLLM_SETTLE_S = 2.0
VLLM_READY_TIMEOUT_S = 600.0


def write_gateway_config(
    setup: Setup, tokenizer_dir: Path, engine_url: str, port: int, folder: Path, *, remote_url: str | None = None
) -> Path:
    config: dict[str, Any] = {
        "model": MODEL,
        "tokenizer": str(tokenizer_dir),
        "engines": [{"url": engine_url}],
        "host": "127.0.0.1",
        "port": port,
        # A saturated 2-core machine (B's stateless derender takes a whole core) stalls idle
        # processes for seconds: the benchmark's gateways wait for their engines instead of
        # opening circuits, which would turn a slow cell into failed requests.
        "timeouts": {"connect_s": 60},
        "health": {"check_timeout_s": 30, "failure_threshold": 100},
        **setup.gateway,
    }
    if remote_url is not None:
        config["remote_url"] = remote_url
    if setup.policy:
        # configs/policy.yaml's batch-tenant rule names a `batch` pool: the same engine here.
        config["pools"] = {"batch": [{"url": engine_url}]}
    path = folder / f"gateway_{setup.name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def vllm_env() -> dict[str, str]:
    """A subprocess in vLLM's venv: offline, a small KV cache, this checkout importable."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    return env


def spawn_vllm(name: str, argv: list[str], port: int, folder: Path) -> Proc:
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv, cwd=ROOT, env=vllm_env(), start_new_session=True, stdout=out, stderr=subprocess.STDOUT
        )
    return Proc(name, popen, f"http://127.0.0.1:{port}", log, group=True)


def start_vllm_server(name: str, vllm_python: Path, model_dir: Path, folder: Path) -> Proc:
    """Stock vLLM's OpenAI server (scripts/vllm_serve.sh), the model served as MODEL."""
    port = free_port()
    argv = ["bash", str(ROOT / "scripts" / "vllm_serve.sh"), str(model_dir), str(port)]
    argv += ["--max-model-len", str(VLLM_MAX_MODEL_LEN), "--served-model-name", MODEL]
    os.environ["ONEHOP_VLLM_PYTHON"] = str(vllm_python)  # vllm_serve.sh finds the venv by it
    return spawn_vllm(name, argv, port, folder)


class Launcher:
    """Starts every setup's processes, sharing A's vLLM server as B's engine; stops them all."""

    def __init__(self, folder: Path, plan: Plan, longest: int, vllm_python: Path | None) -> None:
        self.folder, self.plan, self.longest, self.vllm_python = folder, plan, longest, vllm_python
        self.procs: list[Proc] = []
        self._vllm_main: Proc | None = None
        self._onehop_vllm: Proc | None = None

    def _proc(self, name: str, popen: subprocess.Popen[bytes], port: int) -> Proc:
        proc = Proc(name, popen, f"http://127.0.0.1:{port}", self.folder / f"{name}.log")
        self.procs.append(proc)
        return proc

    def _vllm(self, name: str) -> Proc:
        assert self.vllm_python is not None
        proc = start_vllm_server(name, self.vllm_python, ensure_tiny_model(), self.folder)
        self.procs.append(proc)
        return proc

    def vllm_main(self) -> Proc:
        if self._vllm_main is None:
            self._vllm_main = self._vllm("vllm_main")
        return self._vllm_main

    def onehop_vllm(self, model_dir: Path) -> Proc:
        """`onehop engine --backend vllm`, one for C-vllm, D-vllm and E-vllm (their cells run in turn)."""
        if self._onehop_vllm is None:
            assert self.vllm_python is not None
            port = free_port()
            argv = [str(self.vllm_python), "-m", "onehop", "engine", "--backend", "vllm", "--model", str(model_dir)]
            argv += ["--served-model-name", MODEL, "--port", str(port)]
            argv += ["--backend-option", f"max_model_len={VLLM_MAX_MODEL_LEN}"]
            self._onehop_vllm = spawn_vllm("engine_onehop_vllm", argv, port, self.folder)
            self.procs.append(self._onehop_vllm)
        return self._onehop_vllm

    def gateway(self, setup: Setup, tokenizer_dir: Path, engine_url: str, remote_url: str | None = None) -> Proc:
        port = free_port()
        config = write_gateway_config(setup, tokenizer_dir, engine_url, port, self.folder, remote_url=remote_url)
        name = f"gateway_{setup.name}"
        return self._proc(name, spawn(["gateway", "--config", str(config), "--workers", "1"], self.folder / f"{name}.log"), port)

    def start(self, setup: Setup) -> Servers:
        if setup.kind == "sim":
            tokenizer_dir = ensure_tokenizer()
            port = free_port()
            engine_plan = dataclasses.replace(
                QUICK, tokens=self.longest, itl_ms=self.plan.itl_ms, ttft_ms=self.plan.ttft_ms
            )
            name = f"engine_{setup.name}"
            engine = self._proc(name, start_engine(tokenizer_dir, port, engine_plan, self.folder / f"{name}.log"), port)
            gateway = self.gateway(setup, tokenizer_dir, engine.url)
            return Servers(setup, gateway.url, {"engine": engine, "gateway": gateway}, engine.url)
        model_dir = ensure_tiny_model()
        if setup.kind == "vllm-coupled":
            engine = self.vllm_main()
            return Servers(setup, engine.url, {"engine": engine}, None)
        if setup.kind == "vllm-three-stage":
            engine = self.vllm_main()
            remote = self._vllm("vllm_remote_B")
            gateway = self.gateway(setup, model_dir, engine.url, remote.url)
            # remote_api: the render/derender server's API process alone, without its (idle) engine core.
            remote_api = dataclasses.replace(remote, name=f"{remote.name}_api", group=False)
            tiers = {"engine": engine, "gateway": gateway, "remote": remote, "remote_api": remote_api}
            return Servers(setup, gateway.url, tiers, None)
        if setup.kind == "onehop-vllm":
            engine = self.onehop_vllm(model_dir)
            gateway = self.gateway(setup, model_dir, engine.url)
            return Servers(setup, gateway.url, {"engine": engine, "gateway": gateway}, engine.url)
        raise AssertionError(setup.kind)

    async def wait(self, session: aiohttp.ClientSession) -> None:
        for proc in self.procs:
            await wait_up(session, proc)

    def show_logs(self, tail: int = 3000) -> None:
        for proc in self.procs:
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            print(f"--- {proc.name} ({proc.url}), last {tail} characters of its log:\n{text[-tail:]}", file=sys.stderr)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc.popen)
            if proc.group:  # vLLM's engine core must not outlive its server
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)


def padded_vocab_bias() -> dict[str, float]:
    """`logit_bias` -100 on the tiny model's padding ids (its embedding rows past the tokenizer's
    vocabulary): the random weights sample them, and onehop's derender refuses ids it cannot decode
    (C-vllm's stream would end in an error event). Sent to every vLLM setup alike, never to the sim."""
    from tokenizers import Tokenizer

    model_dir = ensure_tiny_model()
    size = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    rows = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return {str(i): -100.0 for i in range(size, rows)}


def with_logit_bias(prompt: Prompt, bias: dict[str, float]) -> Prompt:
    data = json.loads(prompt.body)
    data["logit_bias"] = bias
    return dataclasses.replace(prompt, body=json.dumps(data).encode())


def rounds(warmup: int, total: int, count: int) -> list[tuple[int, int]]:
    """[first, last) of each round's measured prompts, after the warm-up ones, as even as they split."""
    measured = total - warmup
    count = max(1, min(count, measured))
    edges = [warmup + measured * i // count for i in range(count + 1)]
    return list(itertools.pairwise(edges))


async def wait_up(session: aiohttp.ClientSession, proc: Proc) -> None:
    if not proc.group:
        await wait_ready(session, proc.url, proc.popen, proc.log)
        return
    deadline = time.monotonic() + VLLM_READY_TIMEOUT_S
    started = time.monotonic()
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise BenchError(f"{proc.name} exited with {proc.popen.returncode}: {proc.log.read_text(errors='replace')[-3000:]}")
        try:
            async with session.get(proc.url + "/health") as resp:
                if resp.status == 200:
                    print(f"{proc.name} ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise BenchError(f"{proc.name} was not ready within {VLLM_READY_TIMEOUT_S:.0f} s: {proc.log.read_text(errors='replace')[-2000:]}")


async def measure_all(
    setups: Sequence[Setup],
    workloads: Sequence[Workload],
    plan: Plan,
    rate: float | None,
    vllm_python: Path | None = None,
) -> tuple[list[Cell], float]:
    longest = max(plan.max_tokens(w) for w in workloads)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        launcher = Launcher(folder, plan, longest, vllm_python)
        try:
            servers = [launcher.start(setup) for setup in setups]
            async with client_session() as session:
                await launcher.wait(session)
                startup_s = time.perf_counter() - started
                print(f"{len(launcher.procs)} servers for {len(servers)} setups ready in {startup_s:.1f} s", file=sys.stderr)
                any_vllm = any(s.setup.vllm for s in servers)
                padded = padded_vocab_bias() if any_vllm else {}
                for workload in workloads:
                    plain = prompts(workload, plan, plan.warmup + plan.requests[workload.name])
                    biased = [with_logit_bias(prompt, padded) for prompt in plain] if padded else plain
                    row = {s.setup.name: Cell(s.setup.name, workload.name) for s in servers}
                    for index, (first, last) in enumerate(rounds(plan.warmup, len(plain), plan.rounds)):
                        for s in servers:
                            if any_vllm:
                                # The vLLM engine processes just used spin on their shared-memory
                                # queues for a second after their last read, on the core the next
                                # setup's engine computes on: let them go idle first.
                                await asyncio.sleep(VLLM_SETTLE_S)
                            chosen = biased if s.setup.vllm else plain
                            warm = chosen[: plan.warmup] if index == 0 else []
                            cell = row[s.setup.name]
                            await run_round(session, s, workload, cell, warm, chosen[first:last], plan, rate)
                    cells += row.values()
        except BenchError:
            launcher.show_logs()  # the servers' side of the failure, before their folder goes
            raise
        finally:
            launcher.stop()
    return cells, startup_s


# ------------------------------------------------------------ report


def _per_1k(cpu_s: float, tokens: int) -> float:
    return cpu_s / tokens * 1000 if tokens else math.nan


def summarize(cell: Cell) -> dict[str, Any]:
    tokens = sum(r.output_tokens for r in cell.results)
    series = {
        "ttft": [r.ttft_s for r in cell.results],
        "itl": [gap for r in cell.results for gap in r.itl_s],
        "e2e": [r.e2e_s for r in cell.results],
    }
    row: dict[str, Any] = {
        "setup": cell.setup,
        "workload": cell.workload,
        "requests": len(cell.results),
        "output_tokens": tokens,
    }
    for name, values in series.items():
        for q in PERCENTILES:
            row[f"{name}_p{q}_ms"] = percentile(values, q) * 1000 if values else math.nan
    row["tokens_per_s"] = tokens / cell.wall_s
    for tier in TIERS:
        row[f"{tier}_cpu_s_per_1k_tokens"] = _per_1k(cell.cpu_s.get(tier, math.nan), tokens)
    if "remote" in cell.cpu_s:  # B: vLLM's render + stateless derender server (group; API process alone)
        row["remote_cpu_s_per_1k_tokens"] = _per_1k(cell.cpu_s["remote"], tokens)
        row["remote_api_cpu_s_per_1k_tokens"] = _per_1k(cell.cpu_s["remote_api"], tokens)
    row["engine_output_cores"] = cell.engine_output_cores
    row["wall_s"] = cell.wall_s
    row["cpu_s"] = cell.cpu_s
    row["routes"] = dict(Counter(r.route for r in cell.results))
    row["tool_call_streams"] = sum(r.tool_calls for r in cell.results)
    return row


def _ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return "n/a (a zero reading)"
    return f"×{a / b:.2f}"


def ratio_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Comparisons measured side by side in this run, for the setups present."""
    by = {(r["setup"], r["workload"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    setups = {r["setup"] for r in rows}
    lines = []

    def across(value: Callable[[str, str], float], other: str, base: str) -> str:
        return ", ".join(f"{w} {_ratio(value(other, w), value(base, w))}" for w in workloads)

    def column(key: str) -> Callable[[str, str], float]:
        return lambda setup, workload: by[(setup, workload)][key]

    for suffix in ("", "-vllm"):
        base = f"C{suffix}"
        for other in (f"D{suffix}", f"E{suffix}"):
            if other in setups and base in setups:
                for tier in ("gateway", "engine"):
                    parts = across(column(f"{tier}_cpu_s_per_1k_tokens"), other, base)
                    lines.append(f"{other} {tier} CPU per 1k output tokens vs {base}: {parts}")

    if "A" in setups:
        for other, note, e2e_note in (
            ("C-vllm", "both on vLLM", "; target ≤ ×1.03"),
            ("D-vllm", "both on vLLM", ""),
            ("E-vllm", "both on vLLM", ""),
            ("B", "both on vLLM", "; upstream's gap on long outputs is about ×1.15 on GPUs"),
            ("C", "C on the sim engine, A on vLLM: not like for like", ""),
        ):
            if other in setups:
                for key, label, extra in (("e2e_p50_ms", "E2E", e2e_note), ("ttft_p50_ms", "TTFT", "")):
                    lines.append(f"{other} {label} p50 vs A ({note}{extra}): {across(column(key), other, 'A')}")
        if "B" in setups:

            def all_tiers(setup: str, workload: str) -> float:
                row = by[(setup, workload)]
                return _per_1k(sum(v for t, v in row["cpu_s"].items() if t != "remote_api"), row["output_tokens"])

            parts = across(all_tiers, "B", "A")
            lines.append(f"B all-tier CPU (engine + gateway + remote + client) per 1k output tokens vs A: {parts}")
    # The derender tier: B's vLLM render/derender server against onehop's gateway on the tokens route,
    # on the same vLLM token streams when D-vllm ran (like for like), else D on the sim engine.
    stateful = "D-vllm" if "D-vllm" in setups else "D"
    if "B" in setups and stateful in setups:
        for remote, what in (
            ("remote", "vLLM render + stateless derender server, whole process group"),
            ("remote_api", "that server's API process alone, no engine core"),
        ):
            parts = ", ".join(
                f"{w} {_ratio(by[('B', w)][f'{remote}_cpu_s_per_1k_tokens'], by[(stateful, w)]['gateway_cpu_s_per_1k_tokens'])}"
                f" ({by[('B', w)][f'{remote}_cpu_s_per_1k_tokens']:.4f} vs"
                f" {by[(stateful, w)]['gateway_cpu_s_per_1k_tokens']:.4f} s)"
                for w in workloads
            )
            lines.append(
                f"B derender tier ({what}) CPU per 1k output tokens vs {stateful} derender tier (gateway,"
                f" stateful derender; target ≥ ×9): {parts}"
            )
    for name in ("E", "E-vllm"):
        if name in setups:
            lines += _policy_lines(by, workloads, name)
    return lines


def _policy_lines(by: dict[tuple[str, str], dict[str, Any]], workloads: Sequence[str], name: str) -> list[str]:
    """What a cost-policy setup's engine spent on output against the policy's budget, and where it routed."""
    budget = load_policy(POLICY_FILE).cost.engine_budget_cores
    peak = max(by[(name, w)]["engine_output_cores"] for w in workloads)
    process = max(by[(name, w)]["cpu_s"]["engine"] / by[(name, w)]["wall_s"] for w in workloads)
    verdict = "within" if peak <= budget else "over"
    routes = "; ".join(
        f"{w} " + ", ".join(f"{route} {n}" for route, n in sorted(by[(name, w)]["routes"].items())) for w in workloads
    )
    return [
        (
            f"{name} engine output-processing CPU (onehop_engine_output_cpu_seconds_total): {peak:.3f} cores in its"
            f" busiest cell (mean over the cell), {verdict} the policy's engine_budget_cores {budget:g}"
            f" (whole engine process: {process:.3f} cores in its busiest cell)"
        ),
        f"{name} routes picked by the policy (requests): {routes}",
    ]


def _cell(value: Any, metric: str) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return "n/a"
    if metric.endswith("_ms"):
        return f"{value:.1f}" if value >= 100 else f"{value:.2f}"
    if metric == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.4f}"


def markdown(results: dict[str, Any]) -> str:
    load = results["load"]
    how = (
        f"closed loop, {load['concurrency']} streams"
        if load["mode"] == "closed"
        else f"open loop, Poisson {load['rate']:g} req/s"
    )
    lines = [
        (
            f"Engine: {results['engine_note']} (itl_ms={results['plan']['itl_ms']},"
            f" ttft_ms={results['plan']['ttft_ms']}); one engine and one gateway process per setup; {how};"
            f" {results['cpus']} CPUs; {'quick' if results['plan']['quick'] else 'full'} plan,"
            f" {results['plan']['warmup']} warm-up requests per cell."
            + (
                ""
                if results["engine"] == "sim"
                else " vLLM setups: A is one vLLM server alone (no gateway: gateway CPU n/a); B's engine is that"
                " same vLLM server and its render/derender server a second one (CPU tier `remote`, in the JSON"
                " and the ratio lines); vLLM CPU is its whole process group; engine output cores n/a on vLLM."
            )
        ),
        "",
        "Setups: " + "; ".join(f"{name}: {s['description']}" for name, s in results["setups"].items()) + ".",
        "",
        "| setup | workload | " + " | ".join(HEADERS[m] for m in METRICS) + " | routes |",
        "|---|---|" + "---:|" * len(METRICS) + "---|",
    ]
    for row in results["rows"]:
        routes = ", ".join(f"{route} {n}" for route, n in sorted(row["routes"].items()))
        values = " | ".join(_cell(row[m], m) for m in METRICS)
        lines.append(f"| {row['setup']} | {row['workload']} | {values} | {routes} |")
    lines += ["", *(f"- {line}" for line in results["ratio_lines"])]
    return "\n".join(lines) + "\n"


def plot(cells: Sequence[Cell], rows: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Latency CDFs per workload and CPU per tier per setup; [] (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not importable (it is not a project dependency)", file=sys.stderr)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    workloads = list(dict.fromkeys(c.workload for c in cells))
    setups = list(dict.fromkeys(c.setup for c in cells))
    for workload in workloads:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for cell in (c for c in cells if c.workload == workload):
            series = {
                "ttft": [r.ttft_s for r in cell.results],
                "itl": [gap for r in cell.results for gap in r.itl_s],
                "e2e": [r.e2e_s for r in cell.results],
            }
            for ax, name in zip(axes, LATENCIES, strict=True):
                values = sorted(max(v * 1000, 1e-3) for v in series[name])
                if values:
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=cell.setup)
        for ax, name in zip(axes, LATENCIES, strict=True):
            ax.set_xlabel(f"{name.upper()} (ms{', log scale' if name == 'itl' else ''})")
            if name == "itl":  # gaps span sub-ms bursts to long stalls
                ax.set_xscale("log")
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"latency CDFs: {workload}")
        fig.tight_layout()
        path = folder / f"bench_latency_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    by = {(r["setup"], r["workload"]): r for r in rows}
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 4), squeeze=False)
    width = 0.8 / len(TIERS)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for i, tier in enumerate(TIERS):
            values = [by[(s, workload)][f"{tier}_cpu_s_per_1k_tokens"] for s in setups]
            ax.bar([x + (i - 1) * width for x in range(len(setups))], values, width, label=tier)
        ax.set_xticks(range(len(setups)), setups)
        ax.set_title(workload)
        ax.set_ylabel("CPU s per 1k output tokens")
        ax.legend()
    fig.tight_layout()
    path = folder / "bench_cpu.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def parse_requests(text: str, default: dict[str, int]) -> dict[str, int]:
    """`N` (every workload) or `name=N,...` (those named; the others keep the plan's) → requests per workload."""
    if "=" not in text:
        pairs = [(name, text) for name in default]
    else:
        pairs = [tuple(part.split("=", 1)) for part in text.split(",") if part.strip()]  # type: ignore[misc]
    requests = dict(default)
    for name, count in pairs:
        name = name.strip()
        if name not in default:
            raise ValueError(f"unknown workload {name!r}; available: {','.join(default)}")
        if not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"{name}: {count.strip()!r} is not a count of at least 1")
        requests[name] = int(count)
    return requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few requests, short outputs (CI)")
    parser.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, of: {', '.join(f'{n} ({s.description})' for n, s in SETUPS.items())}."
        f" With a vLLM python (only when named): {', '.join(f'{s.name} ({s.description})' for s in VLLM_SETUPS.values())}",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="vLLM's venv python for A, B, C-vllm, D-vllm, E-vllm (default: $ONEHOP_VLLM_PYTHON, else `bash scripts/setup_vllm.sh`)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: this many streams back to back")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests per second")
    parser.add_argument(
        "--requests",
        default=None,
        help="measured requests per cell: N for every workload, or per workload as reasoning=8,short=64"
        " (default: the plan's, per workload)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured requests per cell (default: the plan's)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="split each cell into this many rounds, interleaved across setups"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder (needs matplotlib)")
    args = parser.parse_args(argv)
    found: list[Path] = []

    def vllm_python() -> tuple[Path | None, str]:
        path, where = find_vllm_python(args.vllm_python)
        if path is not None:
            found.append(path)
        return path, where

    setups = parse_setups(args.setups, vllm_python)
    vllm_path = found[0] if found else None
    workloads = parse_workloads(args.workloads)
    plan = QUICK_PLAN if args.quick else FULL
    if args.concurrency is not None:
        if args.concurrency < 1:
            parser.error("--concurrency must be at least 1")
        plan = dataclasses.replace(plan, concurrency=args.concurrency)
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.requests is not None:
        try:
            plan = dataclasses.replace(plan, requests=parse_requests(args.requests, plan.requests))
        except ValueError as exc:
            parser.error(f"--requests: {exc}")
    if args.warmup is not None:
        if args.warmup < 0:
            parser.error("--warmup must be at least 0")
        plan = dataclasses.replace(plan, warmup=args.warmup)
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        plan = dataclasses.replace(plan, rounds=args.rounds)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        cells, startup_s = runner.run(measure_all(setups, workloads, plan, args.rate, vllm_path))
    rows = [summarize(cell) for cell in cells]
    results: dict[str, Any] = {
        "engine": "sim" if vllm_path is None else "sim+vllm",
        "engine_note": ENGINE_NOTE
        if vllm_path is None
        else (
            f"{', '.join(s.name for s in setups if not s.vllm) or 'none'} on the sim engine;"
            f" {', '.join(s.name for s in setups if s.vllm)} on {VLLM_NOTE}"
        ),
        "cpus": os.cpu_count(),
        "plan": dataclasses.asdict(plan),
        "load": {"mode": "closed", "concurrency": plan.concurrency}
        if args.rate is None
        else {"mode": "open", "rate": args.rate},
        "setups": {s.name: {"description": s.description, "gateway": s.gateway} for s in setups},
        "planned_setups": PLANNED_SETUPS,
        "workloads": {
            w.name: {"description": w.description, "max_tokens": list(plan.lengths(w)), "requests": plan.requests[w.name]}
            for w in workloads
        },
        "metrics": list(METRICS),
        "startup_s": startup_s,
        "rows": rows,
        "ratio_lines": ratio_lines(rows),
        "samples_ms": {
            f"{c.setup}/{c.workload}": {
                "ttft": [r.ttft_s * 1000 for r in c.results],
                "e2e": [r.e2e_s * 1000 for r in c.results],
            }
            for c in cells
        },
    }
    report = markdown(results)
    print(report, end="")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report)
    if args.plots is not None:
        results["plots"] = [str(p) for p in plot(cells, rows, args.plots)]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
