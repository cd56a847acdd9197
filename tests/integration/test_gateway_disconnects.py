"""Disconnect storm: streams cut at random points leave nothing running on the engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.state import ENGINE
from onehop.serve import embedded
from gateway.serving.state import GATEWAY

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

STREAMS = 200
CONCURRENCY = 50


async def _cut_stream(session: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    route = rng.choice(["derender", "text", "tokens"])
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": rng.random() < 0.8,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    request = asyncio.ensure_future(session.post(url, json=body, headers={"onehop-route": route}))
    if rng.random() < 0.2:  # before the first byte
        await asyncio.sleep(rng.random() * 0.02)
        request.cancel()
        (answer,) = await asyncio.gather(request, return_exceptions=True)
        if isinstance(answer, aiohttp.ClientResponse):
            answer.close()  # the headers came before the cut: close it as a client would
        return
    response = await request
    for _ in range(rng.randint(0, 20)):
        if not await response.content.readany():
            break
    response.close()


@SLOW
async def test_two_hundred_cut_streams_leave_no_engine_request(qwen3_tokenizer_dir: Path) -> None:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim", backend_options={"itl_ms": 2})
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        backend = running.engine[ENGINE].backend
        url = running.url + "/v1/chat/completions"
        rng = random.Random(1234)
        gate = asyncio.Semaphore(CONCURRENCY)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                async with gate:
                    await _cut_stream(session, url, rng)

            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(STREAMS))), timeout=120)
        loop = asyncio.get_running_loop()
        last_cut = loop.time()
        while backend.running() and loop.time() - last_cut < 1.0:
            await asyncio.sleep(0.01)
        assert not backend.running(), f"{len(backend.running())} engine requests still running 1 s after the last cut"
        assert not running.engine[ENGINE].running
        # What the operator sees: the cuts are counted on both sides.
        gateway = _samples(running.gateway[GATEWAY].metrics.render())
        engine_side = _samples(running.engine[ENGINE].metrics.render())
        assert gateway["onehop_gateway_engine_aborts_total"] > 0
        assert gateway["onehop_gateway_client_disconnects_total"] > 0
        assert engine_side["onehop_engine_aborts_total"] > 0


def _samples(text: bytes) -> dict[str, float]:
    """Sample values summed over labels, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
