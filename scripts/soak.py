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

Beside the workers run the hostile clients, each a raw socket in a loop:

- `--slow-clients` send a request's headers and trickle its body a byte at a
  time; each must get a 408 within `client_body_s` and hold no admission slot;
- `--stalled-clients` ask for a long stream through a small receive buffer and
  read nothing; each must be cut off after `client_write_s` (no `[DONE]`);
- one key rotator rewrites the API-key file (auth is on, every request carries
  a key): a new key, then bytes that are not UTF-8 (logged and ignored: the
  last good keys stay), then the file without the new key, which must be
  refused within one watch interval (`auth.poll_s`) of the rewrite.

The gateway admits the workers plus the stalled clients at once (a queue
behind them): a slot that a slow body or a stalled stream kept would show as
429s.

Every `--sample-every` seconds: the gateway's and the engine's RSS (VmRSS in
/proc/PID/status) and open fds (/proc/PID/fd), the requests done so far and
the answers by status. At the end: a table of the samples and a verdict that
compares the median of the last third of the samples with the median of the
second third (the first third is warm-up): flat when the gateway's RSS grew
by less than 10% and its fds by fewer than 16.

Exit status: 0 flat, 1 not flat, 2 unexpected errors (a 5xx, an in-band
stream error, a client-side exception other than the deliberate cuts, an
answer of the wrong status: a valid request that did not get 200, an invalid
one that did not get 400, a slow body that did not get its 408, a stalled
stream that was not cut, a key that was not refused in time or a good key
that was).

    .venv/bin/python scripts/soak.py [--duration 600] [--concurrency 16] [--slow-clients 4]
        [--stalled-clients 2] [--sample-every 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import socket
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

from plumbing.http_server import new_event_loop  # noqa: E402
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

KEY_POLL_S = 1.0
"""The gateway's `auth.poll_s`: a revoked key must be refused within this of the rewrite."""
REVOKE_SLACK_S = 0.25
"""Added to KEY_POLL_S for the reload itself on a loaded 2-core machine."""
BODY_TIMEOUT_S = 2.0
WRITE_STALL_S = 2.0
STALL_HOLD_S = 5 * WRITE_STALL_S
"""How long a stalled client reads nothing before it looks at what it got."""
TRICKLE_EVERY_S = 0.5
KEY_CYCLE_PAUSE_S = 5.0
STABLE_KEY = "soak-stable-key"
AUTH = {"Authorization": f"Bearer {STABLE_KEY}"}
NOT_UTF8 = b"\xff\xfe soak \x80\x81 keys\n"

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
    revoke_s: list[float] = field(default_factory=list)
    """Rewrite of the key file → the first 401 for the key it dropped."""
    grant_s: list[float] = field(default_factory=list)
    """Rewrite of the key file → the first 200 for the key it added."""

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
    first = f"Once upon a time, lighthouse {rng.randint(1, 1000)}"
    prompt: str | list[str] = [first, "The harbor at night"] if rng.random() < 0.2 else first
    return {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": rng.randint(8, 64)}


def pick(rng: random.Random) -> Request:
    """One request of the mix: 55% chat, 15% completions, 15% cut streams, 15% invalid."""
    route = rng.choice(ROUTES)
    headers = {"Content-Type": "application/json", "onehop-route": route, **AUTH}
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
    return Request("invalid", path, body, {"Content-Type": "application/json", **AUTH, **extra}, False, expect=400)


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


# ------------------------------------------------------------ hostile clients


def _head_status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


async def slow_body(host: str, port: int, deadline: float, tally: Tally) -> None:
    """Headers, then a byte of body every TRICKLE_EVERY_S: a 408 must come within client_body_s."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {STABLE_KEY}\r\nContent-Length: 100000\r\n\r\n{{"
    ).encode()
    while time.monotonic() < deadline:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head)
            answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            limit = time.monotonic() + BODY_TIMEOUT_S + 10
            while not answer.done() and time.monotonic() < limit:
                await asyncio.wait([answer], timeout=TRICKLE_EVERY_S)
                if not answer.done() and not writer.is_closing():
                    writer.write(b" ")
            if not answer.done():
                answer.cancel()
                tally.surprise("slow-body:no-answer", f"nothing within {BODY_TIMEOUT_S + 10:g} s")
                continue
            status = _head_status(answer.result())
            tally.outcomes["slow-408" if status == 408 else str(status)] += 1
            if status != 408:
                tally.surprise(f"slow-body:{status}", answer.result().decode(errors="replace"))
        except (OSError, asyncio.IncompleteReadError) as exc:
            tally.surprise(f"slow-body:{type(exc).__name__}", str(exc))
        finally:
            writer.close()


async def stalled_stream(host: str, port: int, deadline: float, rng: random.Random, tally: Tally) -> None:
    """A long, wide stream asked for through a 4 KiB receive buffer and not read for STALL_HOLD_S:
    the gateway must have cut it (no `[DONE]` in what arrived)."""
    loop = asyncio.get_running_loop()
    while time.monotonic() < deadline:
        route = rng.choice(ROUTES)
        body = json.dumps(
            # n: 4 and 20 top logprobs: ~10 KB a step, so the server's socket buffers (up to 4 MiB) fill
            # within seconds however loaded the engine is, and the writes stall.
            {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 8000, "ignore_eos": True, "n": 4,
             "logprobs": True, "top_logprobs": 20}
        ).encode()
        request = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {STABLE_KEY}\r\nonehop-route: {route}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            reader, writer = await asyncio.open_connection(sock=sock)
        except OSError as exc:
            sock.close()
            tally.surprise(f"stalled:{type(exc).__name__}", str(exc))
            continue
        try:
            writer.write(request)
            await asyncio.sleep(STALL_HOLD_S)
            received = b""
            try:
                async with asyncio.timeout(30):
                    while piece := await reader.read(1 << 20):
                        received = (received + piece)[-64:]  # only the tail matters
            except ConnectionResetError:
                pass  # the gateway aborted the connection: cut
            if b"data: [DONE]" in received:
                tally.surprise(f"stalled-{route}:not-cut", "the whole stream arrived")
            else:
                tally.outcomes["stall-cut"] += 1
        except (OSError, TimeoutError) as exc:
            tally.surprise(f"stalled-{route}:{type(exc).__name__}", str(exc))
        finally:
            writer.close()


def write_keys(path: Path, data: bytes) -> float:
    """Replace the key file atomically (a sibling, then a rename); the time it was replaced."""
    sibling = path.with_name(path.name + ".new")
    sibling.write_bytes(data)
    os.replace(sibling, path)
    return time.monotonic()


async def key_status(session: aiohttp.ClientSession, base: str, key: str) -> int:
    async with session.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as resp:
        await resp.read()
        return resp.status


async def until_status(session: aiohttp.ClientSession, base: str, key: str, status: int, since: float, limit_s: float) -> float | None:
    """Seconds from `since` until `key` gets `status` (polled every 25 ms); None past `limit_s`."""
    while time.monotonic() - since < limit_s:
        if await key_status(session, base, key) == status:
            return time.monotonic() - since
        await asyncio.sleep(0.025)
    return None


async def rotate_keys(session: aiohttp.ClientSession, base: str, path: Path, deadline: float, tally: Tally) -> None:
    """Add a key, write bytes that are not UTF-8, drop the key: each cycle checks all three."""
    cycle = 0
    while time.monotonic() < deadline - 4 * KEY_POLL_S:
        cycle += 1
        fresh = f"soak-rotated-{cycle}"
        since = write_keys(path, f"# soak keys, cycle {cycle}\n{STABLE_KEY}\n{fresh}\n".encode())
        granted = await until_status(session, base, fresh, 200, since, 5 * KEY_POLL_S)
        if granted is None:
            tally.surprise("keys:not-granted", f"{fresh} still refused {5 * KEY_POLL_S:g} s after it was added")
            continue
        tally.grant_s.append(granted)
        write_keys(path, NOT_UTF8)
        await asyncio.sleep(2.5 * KEY_POLL_S)  # the watcher has seen it, logged it and kept the last good keys
        for key in (STABLE_KEY, fresh):
            if (status := await key_status(session, base, key)) != 200:
                tally.surprise("keys:lost-on-bad-file", f"{key} got {status} after a write that is not UTF-8")
        since = write_keys(path, f"# soak keys, cycle {cycle}, {fresh} revoked\n{STABLE_KEY}\n".encode())
        revoked = await until_status(session, base, fresh, 401, since, 5 * KEY_POLL_S)
        if revoked is None or revoked > KEY_POLL_S + REVOKE_SLACK_S:
            tally.surprise("keys:revoked-late", f"{fresh} refused after {revoked} s (limit {KEY_POLL_S + REVOKE_SLACK_S:g} s)")
        if revoked is not None:
            tally.revoke_s.append(revoked)
        tally.outcomes["key-cycles"] += 1
        await asyncio.sleep(KEY_CYCLE_PAUSE_S)


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


def gateway_config(keys: Path, concurrency: int, stalled: int) -> dict[str, Any]:
    return {
        "auth": {"api_keys_file": str(keys), "poll_s": KEY_POLL_S},
        "timeouts": {"client_body_s": BODY_TIMEOUT_S, "client_write_s": WRITE_STALL_S},
        "admission": {"max_concurrency": concurrency + stalled, "max_queue": 64, "queue_timeout_s": 10},
    }


async def soak(duration: float, concurrency: int, slow: int, stalled: int, every: float) -> dict[str, Any]:
    tokenizer_dir = ensure_tokenizer()
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    tally = Tally()
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        folder = Path(tmp)
        keys = folder / "keys.txt"
        write_keys(keys, f"{STABLE_KEY}\n".encode())
        engine = start_engine(tokenizer_dir, engine_port, ENGINE_PLAN, folder / "engine.log")
        gateway = start_gateway(
            tokenizer_dir, engine_url, gateway_port, folder, extra=gateway_config(keys, concurrency, stalled)
        )
        try:
            async with client_session() as session:
                await wait_ready(session, engine_url, engine, folder / "engine.log")
                await wait_ready(session, gateway_url, gateway, folder / "gateway.log")
                start = time.monotonic()
                end = start + duration
                rngs = [random.Random(SEED + i) for i in range(concurrency + stalled)]
                await asyncio.gather(
                    sampler(start, every, duration, (gateway.pid, engine.pid), tally, samples),
                    *(worker(session, gateway_url, end, rng, tally) for rng in rngs[:concurrency]),
                    *(slow_body("127.0.0.1", gateway_port, end, tally) for _ in range(slow)),
                    *(stalled_stream("127.0.0.1", gateway_port, end, rng, tally) for rng in rngs[concurrency:]),
                    rotate_keys(session, gateway_url, keys, end, tally),
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
            "slow_clients": slow,
            "stalled_clients": stalled,
            "gateway": gateway_config(Path("keys.txt"), concurrency, stalled),
            "sample_every_s": every,
            "engine": {"output_tokens": ENGINE_PLAN.tokens, "itl_ms": ENGINE_PLAN.itl_ms, "ttft_ms": ENGINE_PLAN.ttft_ms},
            "cpus": os.cpu_count(),
        },
        "wall_s": wall,
        "requests": tally.done,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "keys": {"grant_s": tally.grant_s, "revoke_s": tally.revoke_s},
        "samples": samples,
        "verdict": verdict(samples, tally),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, metavar="SECONDS", help="load time (600)")
    parser.add_argument("--concurrency", type=int, default=16, metavar="N", help="closed-loop workers (16)")
    parser.add_argument("--slow-clients", type=int, default=4, metavar="N", help="raw sockets that trickle a body (4)")
    parser.add_argument("--stalled-clients", type=int, default=2, metavar="N", help="streams that are never read (2)")
    parser.add_argument("--sample-every", type=float, default=5.0, metavar="SECONDS", help="sampling period (5)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write samples and verdict here")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.sample_every <= 0 or args.concurrency < 1 or min(args.slow_clients, args.stalled_clients) < 0:
        parser.error("--duration and --sample-every must be positive, --concurrency at least 1, client counts not negative")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        results = runner.run(
            soak(args.duration, args.concurrency, args.slow_clients, args.stalled_clients, args.sample_every)
        )
    print(table(results["samples"]))
    print(f"{results['requests']} requests in {results['wall_s']:.1f} s: {results['outcomes']}")
    for example in results["verdict"]["unexpected_examples"]:
        print(f"unexpected: {example}")
    revoke, grant = results["keys"]["revoke_s"], results["keys"]["grant_s"]
    if revoke:
        print(
            f"key file: {len(revoke)} cycles; a revoked key refused after {statistics.median(revoke):.2f} s median,"
            f" {max(revoke):.2f} s max (poll_s {KEY_POLL_S:g} s); an added key accepted after"
            f" {statistics.median(grant):.2f} s median, {max(grant):.2f} s max"
        )
    print(results["verdict"]["line"])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return int(results["verdict"]["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
