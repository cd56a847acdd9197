"""Prefill/decode disaggregation: the sim engines check the handshake, and a client gone during
prefill aborts it. Answers through a disaggregated gateway: `test_gateway_pipeline.py`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from gateway.config import EngineEndpoint
from tests.support.engine import engine_server, post_json
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather like?"}]
GENERATE = "/inference/v1/generate"


async def test_the_sim_engines_check_the_handshake(qwen3_tokenizer_dir: Path, qwen3_tokenizer: object) -> None:
    prompt = qwen3_tokenizer.encode("hello there, general kenobi")  # type: ignore[attr-defined]
    asking = {"do_remote_decode": True, "do_remote_prefill": False}
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", tokens_only=True) as (prefill_url, _),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (decode_url, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": asking}
        status, answer, _ = await post_json(session, prefill_url + GENERATE, body)
        assert status == 200
        handover = answer["kv_transfer_params"]
        assert handover["do_remote_prefill"] is True and handover["remote_engine_id"].startswith("sim-")
        assert len(answer["choices"][0]["token_ids"]) == 1

        status, answer, _ = await post_json(session, prefill_url + GENERATE, {**body, "sampling_params": {"max_tokens": 5}})
        assert status == 400 and "max_tokens=1" in answer["error"]["message"]

        decode = {"token_ids": prompt, "sampling_params": {"max_tokens": 4}, "kv_transfer_params": handover}
        status, answer, _ = await post_json(session, decode_url + GENERATE, decode)
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 4
        other = {**decode, "token_ids": prompt + prompt}  # another prompt than the one prefilled
        status, answer, _ = await post_json(session, decode_url + GENERATE, other)
        assert status == 400 and "remote_block_ids" in answer["error"]["message"]


async def test_a_client_gone_during_prefill_aborts_it(qwen3_tokenizer_dir: Path) -> None:
    slow = {"ttft_ms": 5000}
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", tokens_only=True, backend_options=slow) as (prefill_url, prefill),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (decode_url, decode),
        gateway_server(qwen3_tokenizer_dir, decode_url, prefill_engines=[EngineEndpoint(url=prefill_url)]) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        request = asyncio.ensure_future(client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=8))
        deadline = asyncio.get_running_loop().time() + 5
        while not prefill.backend.running() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert prefill.backend.running()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        deadline = asyncio.get_running_loop().time() + 2
        while prefill.backend.running() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert not prefill.backend.running(), "the prefill kept running for a client that left"
        assert not decode.backend.running() and decode.backend.remote_decodes == 0  # type: ignore[attr-defined]
