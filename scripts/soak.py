"""Soak: the gateway at steady load for a while; its RSS and open file descriptors should stay flat.

Starts a sim engine and a gateway in front of it as their own process groups
(the helpers of `scripts/bench_gateway.py`), then runs a closed loop of
`--concurrency` aiohttp workers for `--duration` seconds, each issuing one
request after another from a fixed mix:

- chat completions, streamed and not, on the derender, text and tokens routes
  (the `onehop-route` header), with and without thinking, some with `n: 2`,
  some with a required tool call;
- `/v1/completions`, streamed and not, on the same routes;
- streams the client cuts after a few chunks (it closes the connection);
- invalid requests, each expected to get a 400 (broken JSON, no messages,
  `use_beam_search`, `n` over the limit, an unknown route, `suffix`).

Every `--sample-every` seconds: the gateway's and the engine's RSS (VmRSS in
/proc/PID/status) and open fds (/proc/PID/fd), the requests done so far and
the answers by status. At the end: a table of the samples and a verdict that
compares the median of the last third of the samples with the median of the
second third (the first third is warm-up): flat when the gateway's RSS grew
by less than 10% and its fds by fewer than 16.

Exit status: 0 flat, 1 not flat, 2 unexpected errors (a 5xx, an in-band
stream error, a client-side exception other than the deliberate cuts, or an
answer of the wrong status: a valid request that did not get 200, an invalid
one that did not get 400).

    .venv/bin/python scripts/soak.py [--duration 600] [--concurrency 16] [--sample-every 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from engine.http_server import new_event_loop  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    MODEL,
    QUICK,
    client_session,
    free_port,
    start_engine,
    start_gateway,
    stop,
    wait_ready,
)

ROUTES = ("derender", "text", "tokens")
ENGINE_PLAN = dataclasses.replace(QUICK, tokens=64, itl_ms=1, ttft_ms=5)
"""Sim engine: 64 content tokens per answer (requests cap them lower), a step per ms."""

RSS_LIMIT_PCT = 10.0
FDS_LIMIT = 16
CUT_AFTER_EVENTS = 3
SEED = 20240601

_DATA = b"data: "
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'

HI = [{"role": "user", "content": "hi"}]
INVALID: tuple[tuple[str, bytes, dict[str, str]], ...] = (
    ("/v1/chat/completions", b'{"model": "sim", "messages": [', {}),
    ("/v1/chat/completions", b'{"model": "sim"}', {}),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": HI, "use_beam_search": True}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": HI, "n": 100}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": HI}).encode(), {"onehop-route": "nope"}),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "suffix": "there"}).encode(), {}),
)
"""(path, body, extra headers): each answered 400."""

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class SoakError(RuntimeError):
    """The soak could not run (a server failed to start)."""


@dataclass
class Tally:
    done: int = 0
    """Requests finished, whatever their outcome."""
    outcomes: Counter[str] = field(default_factory=Counter)
    """By HTTP status ("200", "400", ...), plus "cut" (deliberate) and "exc:<type>" (client side)."""
    unexpected: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def surprise(self, what: str, detail: str) -> None:
        self.unexpected[what] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{what}: {detail[:300]}")


@dataclass(frozen=True)
class Request:
    kind: str
    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    cut: bool = False
    expect: int = 200


# ------------------------------------------------------------ the mix


def chat_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"Tell me about lighthouse number {rng.randint(1, 1000)}."},
        ],
        "stream": stream,
        "max_tokens": rng.randint(8, 64),
        "chat_template_kwargs": {"enable_thinking": rng.random() < 0.5},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.1:
        body["tools"] = [TOOL]
        body["tool_choice"] = "required"
    return body


def completion_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    prompt: str | list[str] = f"Once upon a time, lighthouse {rng.randint(1, 1000)}"
    if rng.random() < 0.2:
        prompt = [prompt, "The harbor at night"]
    return {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": rng.randint(8, 64)}


def pick(rng: random.Random) -> Request:
    """One request of the mix: 55% chat, 15% completions, 15% cut streams, 15% invalid."""
    route = rng.choice(ROUTES)
    headers = {"Content-Type": "application/json", "onehop-route": route}
    roll = rng.random()
    if roll < 0.55:
        stream = roll < 0.35
        body = json.dumps(chat_body(rng, stream)).encode()
        return Request(f"chat-{'stream' if stream else 'json'}-{route}", "/v1/chat/completions", body, headers, stream)
    if roll < 0.70:
        stream = roll < 0.62
        body = json.dumps(completion_body(rng, stream)).encode()
        return Request(f"completion-{'stream' if stream else 'json'}-{route}", "/v1/completions", body, headers, stream)
    if roll < 0.85:
        chat = roll < 0.80
        body = json.dumps((chat_body if chat else completion_body)(rng, True) | {"max_tokens": 64}).encode()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Request(f"cut-{route}", path, body, headers, True, cut=True)
    path, body, extra = rng.choice(INVALID)
    return Request("invalid", path, body, {"Content-Type": "application/json", **extra}, False, expect=400)


async def issue(session: aiohttp.ClientSession, base: str, request: Request, tally: Tally) -> None:
    async with session.post(base + request.path, data=request.body, headers=request.headers) as resp:
        status = resp.status
        if status != request.expect or not request.stream:
            text = await resp.read()
            tally.outcomes[str(status)] += 1
            if status != request.expect:
                tally.surprise(f"{request.kind}:{status}", text.decode(errors="replace"))
            return
        events = 0
        last = b""
        async for line in resp.content:
            if not line.startswith(_DATA):
                continue
            if line.startswith(_ERROR):
                tally.surprise(f"{request.kind}:in-band-error", line.decode(errors="replace"))
            events += 1
            last = line
            if request.cut and events >= CUT_AFTER_EVENTS:
                resp.close()  # drop the connection mid-stream, as a client that goes away
                tally.outcomes["cut"] += 1
                return
        tally.outcomes[str(status)] += 1
        if not last.startswith(_DONE):
            tally.surprise(f"{request.kind}:no-done", f"{events} events, last {last[:200]!r}")


async def worker(session: aiohttp.ClientSession, base: str, deadline: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < deadline:
        request = pick(rng)
        try:
            await issue(session, base, request, tally)
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.outcomes[f"exc:{type(exc).__name__}"] += 1
            tally.surprise(f"{request.kind}:{type(exc).__name__}", str(exc))
        tally.done += 1


# ------------------------------------------------------------ sampling


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SoakError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(t: float, gateway_pid: int, engine_pid: int, tally: Tally) -> dict[str, Any]:
    return {
        "t": round(t, 2),
        "gateway": {"rss_kb": rss_kb(gateway_pid), "fds": fds(gateway_pid)},
        "engine": {"rss_kb": rss_kb(engine_pid), "fds": fds(engine_pid)},
        "requests": tally.done,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "unexpected": sum(tally.unexpected.values()),
    }


async def sampler(
    start: float, every: float, duration: float, pids: tuple[int, int], tally: Tally, samples: list[dict[str, Any]]
) -> None:
    tick = 0
    while (t := tick * every) <= duration:
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        samples.append(sample(time.monotonic() - start, *pids, tally))
        print(row(samples[-1]), file=sys.stderr, flush=True)
        tick += 1


# ------------------------------------------------------------ verdict and report


def thirds(samples: Sequence[dict[str, Any]]) -> tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]]]:
    n = len(samples)
    return samples[n // 3 : 2 * n // 3], samples[2 * n // 3 :]


def verdict(samples: Sequence[dict[str, Any]], tally: Tally) -> dict[str, Any]:
    second, last = thirds(samples)
    result: dict[str, Any] = {
        "rss_limit_pct": RSS_LIMIT_PCT,
        "fds_limit": FDS_LIMIT,
        "unexpected": dict(tally.unexpected),
        "unexpected_examples": tally.examples,
    }
    if not second or not last:
        result |= {"flat": None, "exit_code": 2 if tally.unexpected else 1, "line": f"verdict: too few samples ({len(samples)})"}
        return result
    growth: dict[str, dict[str, float]] = {}
    for proc in ("gateway", "engine"):
        rss = [statistics.median(s[proc]["rss_kb"] for s in part) for part in (second, last)]
        fd = [statistics.median(s[proc]["fds"] for s in part) for part in (second, last)]
        growth[proc] = {
            "rss_mid_kb": rss[0],
            "rss_last_kb": rss[1],
            "rss_growth_pct": (rss[1] - rss[0]) / rss[0] * 100,
            "fds_mid": fd[0],
            "fds_last": fd[1],
            "fds_growth": fd[1] - fd[0],
        }
    gw, en = growth["gateway"], growth["engine"]
    flat = gw["rss_growth_pct"] < RSS_LIMIT_PCT and gw["fds_growth"] < FDS_LIMIT
    n = len(samples)
    line = (
        f"verdict: {'flat' if flat else 'NOT flat'}: gateway RSS {gw['rss_mid_kb'] / 1024:.1f} -> {gw['rss_last_kb'] / 1024:.1f} MiB"
        f" ({gw['rss_growth_pct']:+.1f}%, limit < {RSS_LIMIT_PCT:g}%), fds {gw['fds_mid']:g} -> {gw['fds_last']:g}"
        f" ({gw['fds_growth']:+g}, limit < {FDS_LIMIT}); median of samples {n // 3 + 1}-{2 * n // 3} vs {2 * n // 3 + 1}-{n};"
        f" engine RSS {en['rss_growth_pct']:+.1f}%, fds {en['fds_growth']:+g}; {tally.done} requests"
    )
    if tally.unexpected:
        line += f"; UNEXPECTED ERRORS: {dict(tally.unexpected)}"
    result |= {"flat": flat, **growth, "exit_code": 2 if tally.unexpected else (0 if flat else 1), "line": line}
    return result


def row(s: dict[str, Any]) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in s["outcomes"].items() if k != "200") or "-"
    return (
        f"| {s['t']:7.1f} | {s['gateway']['rss_kb'] / 1024:8.1f} | {s['gateway']['fds']:5d}"
        f" | {s['engine']['rss_kb'] / 1024:8.1f} | {s['engine']['fds']:5d} | {s['requests']:8d} | {s['unexpected']:4d} | {errors} |"
    )


def table(samples: Sequence[dict[str, Any]]) -> str:
    head = [
        "|   t (s) | gw RSS (MiB) | gw fds | eng RSS (MiB) | eng fds | requests | unexp | not 200 (cut = deliberate) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    return "\n".join([*head, *(row(s) for s in samples)])


# ------------------------------------------------------------ run


async def soak(duration: float, concurrency: int, every: float) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    tally = Tally()
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        folder = Path(tmp)
        engine = start_engine(tokenizer_dir, engine_port, ENGINE_PLAN, folder / "engine.log")
        gateway = start_gateway(tokenizer_dir, engine_url, gateway_port, folder)
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                await wait_ready(session, gateway_url, gateway, folder / "gateway.log")
                start = time.monotonic()
                rngs = [random.Random(SEED + i) for i in range(concurrency)]
                await asyncio.gather(
                    sampler(start, every, duration, (gateway.pid, engine.pid), tally, samples),
                    *(worker(session, gateway_url, start + duration, rng, tally) for rng in rngs),
                )
                wall = time.monotonic() - start
            for name, process in (("gateway", gateway), ("engine", engine)):
                if process.poll() is not None:
                    tally.surprise(f"{name}:exited", f"exit status {process.returncode}")
        finally:
            stop(gateway)
            stop(engine)
    return {
        "config": {
            "duration_s": duration,
            "concurrency": concurrency,
            "sample_every_s": every,
            "engine": {"output_tokens": ENGINE_PLAN.tokens, "itl_ms": ENGINE_PLAN.itl_ms, "ttft_ms": ENGINE_PLAN.ttft_ms},
            "cpus": os.cpu_count(),
        },
        "wall_s": wall,
        "requests": tally.done,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "samples": samples,
        "verdict": verdict(samples, tally),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, metavar="SECONDS", help="load time (600)")
    parser.add_argument("--concurrency", type=int, default=16, metavar="N", help="closed-loop workers (16)")
    parser.add_argument("--sample-every", type=float, default=5.0, metavar="SECONDS", help="sampling period (5)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write samples and verdict here")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.sample_every <= 0 or args.concurrency < 1:
        parser.error("--duration and --sample-every must be positive, --concurrency at least 1")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(soak(args.duration, args.concurrency, args.sample_every))
    print(table(results["samples"]))
    print(f"{results['requests']} requests in {results['wall_s']:.1f} s: {results['outcomes']}")
    for example in results["verdict"]["unexpected_examples"]:
        print(f"unexpected: {example}")
    print(results["verdict"]["line"])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return int(results["verdict"]["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
