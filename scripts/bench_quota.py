"""The tenant quota check's cost per request, beside the request's own gateway CPU.

Two measurements, on one machine:

- `check`: in this process, `--checks` reserve + settle pairs of one tenant with a token and
  a request limit (`gateway.edge.quota.MemoryQuotas`, and `RedisQuotas` against a
  `redis-server` this script starts on a free loopback port), one after the other; the CPU
  of this process (`time.process_time`) and the wall time per pair. Redis's wall time is
  one round trip per operation; its server's CPU is not counted.
- `gateway`: three `python -m onehop gateway` processes (`--workers 1`) in front of one sim
  engine (`--tokens` output tokens, no delays), each with an API key of tenant `alpha`:
  `none` (no quota), `memory` and `redis` (a tokens_per_minute and a requests_per_minute
  that are never reached). `--requests` non-streamed chat completions through each, at
  `--concurrency`, after a warm-up; each gateway's CPU (utime + stime from /proc) per
  request, and what `memory` and `redis` add to `none`'s, in 5 interleaved rounds. The
  engine's CPU is not counted.

The table's `ratio` is the check's CPU per request over the `none` gateway's CPU per request.

    .venv/bin/python scripts/bench_quota.py [--quick] [--checks N] [--requests N]
        [--concurrency N] [--tokens N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from gateway.config import StateConfig  # noqa: E402
from gateway.edge.quota import Limit, MemoryQuotas, QuotaStore  # noqa: E402
from gateway.edge.redis_quota import RedisQuotas  # noqa: E402
from scripts.bench_gateway import (  # noqa: E402
    MODEL,
    QUICK,
    BenchError,
    client_session,
    free_port,
    process_cpu,
    start_engine,
    start_gateway,
    stop,
    wait_ready,
)

KEY = "key-alpha"
LIMITS = (Limit("tokens_per_minute", 1_000_000_000, 60.0), Limit("requests_per_minute", 10_000_000, 60.0))
QUOTA = {"tokens_per_minute": 1_000_000_000, "requests_per_minute": 10_000_000}
REDIS_READY_S = 10.0
ROUNDS = 5


@dataclass(frozen=True)
class Settings:
    checks: int
    requests: int
    concurrency: int
    tokens: int


FULL = Settings(checks=5000, requests=2000, concurrency=16, tokens=16)
QUICK_SETTINGS = Settings(checks=300, requests=100, concurrency=8, tokens=16)


# ------------------------------------------------------------ the check alone


async def time_checks(store: QuotaStore, count: int) -> dict[str, float]:
    """CPU and wall time per reserve + settle, after a few unmeasured ones."""
    for i in range(20):
        await _pair(store, f"warm-{i}")
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(count):
        await _pair(store, f"r-{i}")
    return {
        "cpu_us_per_check": (time.process_time() - cpu) / count * 1e6,
        "wall_us_per_check": (time.perf_counter() - wall) / count * 1e6,
    }


async def _pair(store: QuotaStore, reservation: str) -> None:
    decision = await store.reserve("alpha", reservation, LIMITS, 200)
    if not decision.admitted:
        raise BenchError("the bench's quota refused a request")
    await store.settle("alpha", reservation, LIMITS, 150)


class RedisProcess:
    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with (folder / "redis.log").open("wb") as log:
            self.process = subprocess.Popen(args, cwd=folder, stdout=log, stderr=subprocess.STDOUT)

    async def ready(self) -> None:
        client = aioredis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + REDIS_READY_S
        try:
            while time.monotonic() < deadline:
                try:
                    if await client.ping():
                        return
                except (OSError, aioredis.RedisError):
                    await asyncio.sleep(0.05)
            raise BenchError(f"redis-server did not answer within {REDIS_READY_S} s")
        finally:
            await client.aclose()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


# ------------------------------------------------------------ through a gateway


async def _ask(session: aiohttp.ClientSession, url: str, body: bytes, tokens: int) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    async with session.post(url, data=body, headers=headers) as response:
        answer = await response.json()
        if response.status != 200 or answer["usage"]["completion_tokens"] != tokens:
            raise BenchError(f"{url} answered {response.status}: {str(answer)[:300]}")


def chat_body(tokens: int) -> bytes:
    return json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
        "max_tokens": tokens, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False},
    }).encode()  # fmt: skip


async def send(session: aiohttp.ClientSession, base: str, settings: Settings, count: int) -> None:
    """`count` chat completions through the gateway at `base`, `settings.concurrency` at once."""
    url, body = base + "/v1/chat/completions", chat_body(settings.tokens)
    left = [count]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await _ask(session, url, body, settings.tokens)

    await asyncio.gather(*(worker() for _ in range(settings.concurrency)))


async def gateway_cpu(
    session: aiohttp.ClientSession, gateways: dict[str, tuple[str, int]], settings: Settings
) -> dict[str, float]:
    """Each gateway's CPU per request, in µs: `ROUNDS` rounds, each sending a share of the
    requests through every gateway in turn, so that the machine's other load falls on all alike."""
    spent = dict.fromkeys(gateways, 0.0)
    for base, _ in gateways.values():  # warm-up: connections, first renders
        await send(session, base, settings, settings.concurrency * 2)
    share = max(1, settings.requests // ROUNDS)
    for _ in range(ROUNDS):
        for name, (base, pid) in gateways.items():
            before = process_cpu(pid)
            await send(session, base, settings, share)
            spent[name] += process_cpu(pid) - before
    return {name: cpu / (share * ROUNDS) * 1e6 for name, cpu in spent.items()}


async def measure(settings: Settings) -> dict[str, Any]:
    tokenizer = ensure_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as tmp:
        folder = Path(tmp)
        redis_server = RedisProcess(folder)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            await redis_server.ready()
            checks = {"memory": await time_checks(MemoryQuotas(), settings.checks)}
            store = RedisQuotas(StateConfig(backend="redis", url=redis_server.url, key_prefix=f"bench-{uuid.uuid4().hex}:"))
            try:
                checks["redis"] = await time_checks(store, settings.checks)
            finally:
                await store.close()
            (folder / "keys").write_text(f"alpha {KEY}\n")
            engine_port = free_port()
            plan = type(QUICK)(**{**QUICK.__dict__, "tokens": settings.tokens, "itl_ms": 0, "ttft_ms": 0})
            processes.append(start_engine(tokenizer, engine_port, plan, folder / "engine.log"))
            engine_url = f"http://127.0.0.1:{engine_port}"
            auth = {"api_keys_file": str(folder / "keys")}
            configs: dict[str, dict[str, Any]] = {
                "none": {"auth": auth},
                "memory": {"auth": auth, "tenants": {"alpha": QUOTA}},
                "redis": {"auth": auth, "tenants": {"alpha": QUOTA}, "state": {"backend": "redis", "url": redis_server.url}},
            }
            ports = {name: free_port() for name in configs}
            for name, extra in configs.items():
                processes.append(start_gateway(tokenizer, engine_url, ports[name], folder, name=name, extra=extra))
            async with client_session() as session:
                await wait_ready(session, engine_url, processes[0], folder / "engine.log")
                for name, process in zip(configs, processes[1:], strict=True):
                    await wait_ready(session, f"http://127.0.0.1:{ports[name]}", process, folder / f"{name}.log")
                gateways = await gateway_cpu(
                    session,
                    {
                        name: (f"http://127.0.0.1:{ports[name]}", process.pid)
                        for name, process in zip(configs, processes[1:], strict=True)
                    },
                    settings,
                )
        finally:
            for process in processes:
                stop(process)
            redis_server.stop()
    return {"settings": settings.__dict__, "checks": checks, "gateway_cpu_us_per_request": gateways}


def table(result: dict[str, Any]) -> str:
    request = result["gateway_cpu_us_per_request"]
    lines = [
        "| store | check CPU µs (reserve + settle) | check wall µs | gateway CPU µs / request | added to `none` | ratio |",
        "|---|---:|---:|---:|---:|---:|",
        f"| none | — | — | {request['none']:.0f} | — | — |",
    ]
    for name in ("memory", "redis"):
        check = result["checks"][name]
        added = request[name] - request["none"]
        ratio = check["cpu_us_per_check"] / request["none"]
        lines.append(
            f"| {name} | {check['cpu_us_per_check']:.1f} | {check['wall_us_per_check']:.1f} "
            f"| {request[name]:.0f} | {added:+.0f} | {ratio:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--checks", type=int)
    parser.add_argument("--requests", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = QUICK_SETTINGS if args.quick else FULL
    given = {name: getattr(args, name) for name in ("checks", "requests", "concurrency", "tokens")}
    settings = Settings(**{**base.__dict__, **{k: v for k, v in given.items() if v is not None}})
    result = asyncio.run(measure(settings))
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
