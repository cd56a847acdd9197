"""Prefill/decode disaggregation through the gateway, against sim engines that check the handshake."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.config import EngineEndpoint
from tests.support.engine import engine_server, post_json
from tests.support.gateway import gateway_server

MESSAGES = [{"role": "user", "content": "What is the weather like?"}]
GENERATE = "/inference/v1/generate"


async def test_chat_is_prefilled_then_decoded_with_the_handed_over_kv(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", tokens_only=True) as (prefill_url, prefill),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (decode_url, decode),
        gateway_server(qwen3_tokenizer_dir, decode_url, prefill_engines=[EngineEndpoint(url=prefill_url)]) as (pd_base, _),
        gateway_server(qwen3_tokenizer_dir, decode_url) as (plain_base, _),
        openai.AsyncOpenAI(base_url=pd_base, api_key="none", max_retries=0) as pd,
        openai.AsyncOpenAI(base_url=plain_base, api_key="none", max_retries=0) as plain,
    ):
        served = 0
        for route in ("derender", "text", "tokens"):
            headers = {"onehop-route": route}
            answer = await pd.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=24, seed=7, extra_headers=headers)
            reference = await plain.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=24, seed=7, extra_headers=headers)
            assert answer.choices[0].message == reference.choices[0].message
            assert answer.usage == reference.usage
            stream = await pd.chat.completions.create(
                model="sim", messages=MESSAGES, max_tokens=24, seed=7, stream=True, extra_headers=headers
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices[0].finish_reason == reference.choices[0].finish_reason
            served += 2
        backend_p, backend_d = prefill.backend, decode.backend
        assert backend_p.prefills == served  # type: ignore[attr-defined]
        assert backend_d.remote_decodes == served  # type: ignore[attr-defined]
        assert backend_p.remote_decodes == 0 and backend_d.prefills == 0  # type: ignore[attr-defined]


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


async def test_completions_are_disaggregated_too(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", tokens_only=True) as (prefill_url, prefill),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (decode_url, decode),
        gateway_server(qwen3_tokenizer_dir, decode_url, prefill_engines=[EngineEndpoint(url=prefill_url)]) as (pd_base, _),
        gateway_server(qwen3_tokenizer_dir, decode_url) as (plain_base, _),
        openai.AsyncOpenAI(base_url=pd_base, api_key="none", max_retries=0) as pd,
        openai.AsyncOpenAI(base_url=plain_base, api_key="none", max_retries=0) as plain,
    ):
        for route in ("derender", "tokens"):
            headers = {"onehop-route": route}
            prompts = ["Once upon a time", "The weather today"]
            answer = await pd.completions.create(model="sim", prompt=prompts, max_tokens=6, seed=3, extra_headers=headers)
            reference = await plain.completions.create(model="sim", prompt=prompts, max_tokens=6, seed=3, extra_headers=headers)
            assert [c.text for c in answer.choices] == [c.text for c in reference.choices]
            stream = await pd.completions.create(
                model="sim", prompt=prompts[0], max_tokens=6, seed=3, stream=True, extra_headers=headers
            )
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == reference.choices[0].text
        assert prefill.backend.prefills == 6  # type: ignore[attr-defined]
        assert decode.backend.remote_decodes == 6  # type: ignore[attr-defined]
