"""vLLM's own KV events: its classes, encoded as its publisher does, decode here and feed the
index (built in vLLM's venv, a subprocess, read back in the project's); and a live stock vLLM
0.32 on CPU, with prefix caching and `--kv-events-config`, publishing events that the
gateway's subscriber indexes and routes by.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.config import Balancing, EngineEndpoint, GatewayConfig, KVIndexConfig
from gateway.routing.kv_index import KVIndex, request_extra_keys
from gateway.upstream.kv_events import KVSubscriber
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.waiting import wait_until
from tests.support.ports import free_port
from tests.vllm.conftest import ROOT, server_env, servers
from wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.vllm

ENCODE = """
import sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

stored = dict(token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU")
batches = [
    KVEventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, lora_name=None, **stored),
        BlockStored(block_hashes=[21, 22], parent_block_hash=None, lora_name="my-lora",
                    extra_keys=[("my-lora", "salt"), ("my-lora",)], **stored),
    ], data_parallel_rank=0),
    KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[12], medium="GPU"), AllBlocksCleared()]),
]
encoder = msgspec.msgpack.Encoder()
sys.stdout.write("\\n".join(encoder.encode(batch).hex() for batch in batches))
"""
ENCODE_TIMEOUT_S = 120.0


def test_vllms_event_batches_decode_and_index(vllm_python: Path) -> None:
    done = subprocess.run(
        [str(vllm_python), "-c", ENCODE], cwd=ROOT, env=server_env(), capture_output=True, timeout=ENCODE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    first, second = (decode_batch(bytes.fromhex(line)) for line in done.stdout.decode().split())
    assert first.data_parallel_rank == 0 and [type(event) for event in first.events] == [BlockStored, BlockStored]
    assert [type(event) for event in second.events] == [BlockRemoved, AllBlocksCleared]

    index = KVIndex(block_size=16)
    index.apply("http://engine", first.events)
    prompt = list(range(32))
    assert index.match(prompt) == {"http://engine": 2}
    assert index.match(prompt, request_extra_keys(2, lora_name="my-lora", cache_salt="salt")) == {"http://engine": 2}
    index.apply("http://engine", second.events[:1])
    assert index.match(prompt) == {"http://engine": 1}
    index.apply("http://engine", second.events[1:])
    assert index.size == 0


# ------------------------------------------------------------ a live vLLM publishing, the gateway routing by it

BLOCK = 32
"""vLLM's CPU attention takes block sizes that are multiples of 32 only."""


@pytest.fixture(scope="module")
def publishing_vllm(vllm_python: Path, tiny_model_dir: Path) -> Iterator[tuple[str, str, str]]:
    """A stock vLLM with prefix caching publishing its KV events: (its URL, events, replay endpoints)."""
    port, events, replay = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
        # A wildcard host makes vLLM bind (a named host makes its PUB connect to the subscriber).
        "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
    }
    argv = [
        "bash", str(ROOT / "scripts" / "vllm_serve.sh"), str(tiny_model_dir), str(port), "--served-model-name", "tiny",
        "--max-model-len", "2048", "--block-size", str(BLOCK), "--enable-prefix-caching",
        "--kv-events-config", json.dumps(config),
    ]
    with servers([("stock vLLM publishing KV events", argv, port)], server_env(ONEHOP_VLLM_PYTHON=str(vllm_python))) as (
        vllm,
    ):
        yield vllm.url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"


async def test_a_live_vllm_publishes_what_the_gateway_indexes_and_routes_by(
    publishing_vllm: tuple[str, str, str], tiny_model_dir: Path
) -> None:
    vllm, events, replay = publishing_vllm
    prompt = list(range(1000, 1000 + BLOCK * 6 + 11))  # six full blocks and a tail
    async with engine_server(tiny_model_dir, served_model_name="tiny") as (sim, _):  # the other candidate: no events
        config = GatewayConfig(
            model="tiny", tokenizer=str(tiny_model_dir), route_header=True, policy_header=True,
            engines=[EngineEndpoint(url=vllm, kv_events=events, kv_replay=replay, kv_topic="kv"), EngineEndpoint(url=sim)],
            balancing=Balancing(mode="kv_cache", kv_index=KVIndexConfig(block_size=BLOCK)),
        )
        async with configured_gateway(config) as (base, state), aiohttp.ClientSession() as http:
            index = state.clients[0].store.index
            assert index is not None
            subscriber = state.clients[0].kv_subscribers[vllm]
            # The prompt straight to vLLM, until an event of it reaches the gateway (a PUB drops
            # what it sends before the subscription reaches it; vLLM re-publishes a cached prompt).
            for attempt in range(60):
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
                async with http.post(vllm + "/inference/v1/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                try:
                    await wait_until(lambda: subscriber.stats["BlockStored"] > 0, timeout=0.5)
                    break
                except AssertionError:
                    assert attempt < 59, "vLLM's KV events never reached the gateway"
            assert index.counts() == {vllm: 6} and index.match(prompt) == {vllm: 6}  # exactly its full blocks
            # A longer prompt sharing them goes to vLLM by its cache: first its six blocks, then
            # (once vLLM published the longer prompt's seventh) all seven.
            longer = [*prompt, *range(50, 50 + BLOCK)]
            for cached in (6, 7, 7):
                if cached == 7:
                    await wait_until(lambda: index.match(longer) == {vllm: 7}, what="the seventh block indexed")
                async with http.post(base + "/completions", json={"model": "tiny", "prompt": longer, "max_tokens": 2},
                                     headers={"onehop-route": "tokens"}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["onehop-engine"] == vllm
                    assert f"engine by cache: {cached * BLOCK} tokens cached" in resp.headers["onehop-policy"]


async def test_the_vllm_backend_passes_the_flags_to_vllm_and_names_its_events(
    vllm_python: Path, tiny_model_dir: Path
) -> None:
    port, events = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    argv = [
        str(vllm_python), "-m", "onehop", "engine", "--backend", "vllm", "--model", str(tiny_model_dir),
        "--port", str(port), "--backend-option", "max_model_len=2048",
        "--enable-prefix-caching", "--block-size", str(BLOCK), "--kv-events-config", json.dumps(config),
    ]
    prompt = list(range(2000, 2000 + BLOCK * 3 + 5))
    with servers([("onehop engine (vllm backend) publishing KV events", argv, port)],
                 server_env(ONEHOP_VLLM_PYTHON=str(vllm_python))) as (engine,):
        async with aiohttp.ClientSession() as http:
            async with http.get(engine.url + "/inference/v1/capabilities") as resp:
                named = (await resp.json())["kv_events"]
            assert named == {"endpoint": f"tcp://127.0.0.1:{events}", "replay_endpoint": None, "topic": "kv",
                             "block_size": BLOCK}
            index = KVIndex(block_size=BLOCK)
            subscriber = KVSubscriber(engine=engine.url, endpoint=named["endpoint"], index=index, topic="kv")
            subscriber.start()
            try:
                for attempt in range(60):  # until the subscription has taken and an event of the prompt came
                    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
                    async with http.post(engine.url + "/inference/v1/generate", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    try:
                        await wait_until(lambda: index.match(prompt) == {engine.url: 3}, timeout=0.5)
                        break
                    except AssertionError:
                        assert attempt < 59, "the engine's KV events never came"
                async with http.post(engine.url + "/reset_prefix_cache") as resp:
                    assert resp.status == 200
                # vLLM publishes a step's events with the next step: another request carries the clear out.
                other = {"token_ids": [7] * (BLOCK + 1), "sampling_params": {"max_tokens": 1, "temperature": 0}}
                async with http.post(engine.url + "/inference/v1/generate", json=other) as resp:
                    assert resp.status == 200, await resp.text()
                await wait_until(lambda: index.match(prompt) == {}, what="vLLM's AllBlocksCleared applied")
            finally:
                await subscriber.close()
