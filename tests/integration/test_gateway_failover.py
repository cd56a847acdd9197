"""Three sim engines (real processes) behind one gateway; one is killed mid-run, then restarted.

Requests that had not reached the client yet succeed on the others (retried
before the first byte); streams on the killed engine end with an OpenAI error
event and `[DONE]`; its circuit opens, and closes again once it is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Health
from tests.support.engine import wait_healthy
from tests.support.gateway import gateway_server
from tests.support.ports import free_port

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]



def _start_engine(tokenizer: Path, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "onehop", "engine", "--backend", "sim", "--model", str(tokenizer),
        "--served-model-name", "sim", "--port", str(port), "--backend-option", "itl_ms=25",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


@asynccontextmanager
async def _engines(tokenizer: Path, count: int) -> AsyncIterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    ports = [free_port() for _ in range(count)]
    running = [(f"http://127.0.0.1:{p}", _start_engine(tokenizer, p)) for p in ports]
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(session, url, proc) for url, proc in running))
        yield running
    finally:
        for _, process in running:
            _kill(process)


def _circuits(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_engine_circuit_open":
            return {s.labels["engine"]: s.value for s in family.samples}
    return {}


@SLOW
async def test_engine_killed_mid_run_then_restarted(qwen3_tokenizer_dir: Path) -> None:
    # A generous check timeout: on a loaded machine a live engine must never look dead; the
    # killed one refuses connections at once, so detection does not wait for it. The threshold
    # leaves room above the victim's broken streams (each one failure): whichever the gateway
    # sees first, the breaks or the new requests, some new requests still reach the victim
    # before its circuit opens, so the retries below are there to count.
    health = Health(interval_s=0.2, check_timeout_s=2.0, failure_threshold=8, open_s=30, retries=2)
    async with _engines(qwen3_tokenizer_dir, 3) as engines:
        victim_url, victim = engines[1]
        async with gateway_server(qwen3_tokenizer_dir, [url for url, _ in engines], health=health) as (base, state):
            metrics_url = base.removesuffix("/v1") + "/metrics"
            async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client, aiohttp.ClientSession() as session:

                started = asyncio.Semaphore(0)

                async def stream_one() -> str:
                    try:
                        stream = await client.chat.completions.create(
                            model="sim", messages=MESSAGES, max_tokens=160, stream=True, extra_body={"ignore_eos": True}
                        )
                        first = True
                        async for _ in stream:
                            if first:
                                started.release()
                                first = False
                    except openai.APIError as exc:
                        return f"error: {exc.message}"
                    return "ok"

                # Streams spread over the three engines (power of two choices); once every one has
                # its first chunk (so none can be retried elsewhere: 160 tokens at 25 ms leave ~4 s),
                # one engine dies.
                streams = [asyncio.ensure_future(stream_one()) for _ in range(9)]
                for _ in streams:
                    await asyncio.wait_for(started.acquire(), timeout=30)
                on_victim = state.model("sim").engines.store.endpoints[victim_url].outstanding
                assert on_victim > 0
                _kill(victim)
                # Requests that start now: the victim refuses connections until its circuit
                # opens; every one of them is retried on a live engine.
                whole = await asyncio.gather(
                    *(client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4) for _ in range(12))
                )
                assert all(answer.usage is not None and answer.usage.completion_tokens == 4 for answer in whole)
                outcomes = await asyncio.gather(*streams)
                broken = [o for o in outcomes if o != "ok"]
                assert len(broken) == on_victim, outcomes  # the victim's streams, and only those
                assert all(o.startswith("error: the engine stream broke") for o in broken), broken

                async with session.get(metrics_url) as resp:
                    assert _circuits(await resp.text())[victim_url] == 1

                # Back on the same port: a passing health check closes the circuit.
                port = int(victim_url.rsplit(":", 1)[1])
                restarted = _start_engine(qwen3_tokenizer_dir, port)
                try:
                    await wait_healthy(session, victim_url, restarted)
                    deadline = time.monotonic() + 10
                    closed = False
                    while time.monotonic() < deadline and not closed:
                        async with session.get(metrics_url) as resp:
                            closed = _circuits(await resp.text())[victim_url] == 0
                        await asyncio.sleep(0.1)
                    assert closed, "the circuit did not close after the engine came back"
                    for _ in range(30):
                        await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
                    async with session.get(victim_url + "/metrics") as resp:
                        served = sum(
                            s.value
                            for f in text_string_to_metric_families(await resp.text())
                            if f.name == "onehop_engine_requests"
                            for s in f.samples
                            if s.name.endswith("_total")
                        )
                    assert served > 0, "the restarted engine got no traffic"
                finally:
                    _kill(restarted)
            # Retries are counted on the engine that failed.
            retried = {url: state.metrics.engine_retries.labels(url)._value.get() for url, _ in engines}
            assert retried[victim_url] >= 1 and sum(retried.values()) == retried[victim_url]


def _engine_metric(text: str, name: str) -> float:
    """The sum of an engine metric's samples (over output modes and statuses)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


async def _in_flight(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        return _engine_metric(await resp.text(), "onehop_engine_in_flight_requests")


async def test_a_request_whose_engine_is_killed_while_serving_it_is_not_replayed(qwen3_tokenizer_dir: Path) -> None:
    """Issue #27: the engine that served a request is killed while it generates (as a grammar
    that crashed its library killed it): the client gets a 502 saying the engine failed while
    serving it, and the request is not replayed on the pool's other engine."""
    health = Health(interval_s=60, failure_threshold=1000, retries=2)
    async with (
        _engines(qwen3_tokenizer_dir, 2) as engines,
        gateway_server(qwen3_tokenizer_dir, [url for url, _ in engines], health=health) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}  # 10 s at 25 ms a token
        answer = asyncio.ensure_future(session.post(base + "/chat/completions", json=body))
        serving: list[tuple[str, subprocess.Popen[bytes]]] = []
        while not serving:  # until one engine holds it
            assert not answer.done()
            await asyncio.sleep(0.02)
            serving = [(url, p) for url, p in engines if await _in_flight(session, url) > 0]
        (victim_url, victim), = serving
        _kill(victim)
        async with await answer as resp:
            status, error = resp.status, (await resp.json())["error"]
        assert status == 502 and "failed while serving this request" in error["message"], (status, error)
        other = next(url for url, _ in engines if url != victim_url)
        async with session.get(other + "/metrics") as resp:
            assert _engine_metric(await resp.text(), "onehop_engine_requests_total") == 0  # never replayed there
