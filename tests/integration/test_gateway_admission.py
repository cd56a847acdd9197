"""Admission control, operator limits and API keys, through the openai SDK against real servers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from gateway.config import Admission, Auth, Limits
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]


async def _stream_all(client: openai.AsyncOpenAI) -> float:
    """Stream one answer; the seconds it took."""
    started = time.perf_counter()
    stream = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=20, stream=True)
    async for _ in stream:
        pass
    return time.perf_counter() - started


async def test_overload_at_four_times_capacity_gets_quick_503s(qwen3_tokenizer_dir: Path) -> None:
    """One tenant (no keys) over the pool's capacity: the pool is saturated, a 503 with
    `Retry-After` (llm-d's flow control), not a 429 (which says the tenant is over its own limit)."""
    admission = Admission(max_concurrency=2, max_queue=2, queue_timeout_s=30, retry_after_s=3)
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", backend_options={"itl_ms": 20}) as (engine, _),
        gateway_server(qwen3_tokenizer_dir, engine, admission=admission) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        alone = await _stream_all(client)

        async def one() -> tuple[str, float, str | None]:
            started = time.perf_counter()
            try:
                took = await _stream_all(client)
            except openai.InternalServerError as exc:
                assert exc.status_code == 503 and exc.code == "overloaded"
                return "503", time.perf_counter() - started, exc.response.headers.get("retry-after")
            return "ok", took, None

        results = await asyncio.gather(*(one() for _ in range(8)))
    served = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "503"]
    assert len(served) == 4 and len(refused) == 4  # 2 running + 2 queued; the rest refused
    assert all(retry == "3" for _, _, retry in refused)
    # Refusals are immediate: well before even one answer could finish.
    assert max(took for _, took, _ in refused) < alone / 2
    # The admitted ones waited at most one answer's time in the queue.
    assert max(took for _, took, _ in served) < alone * 2 + 1.0
    assert state.gate is not None and state.gate.rejected == 4 and state.gate.waiting == 0


async def test_queue_timeout_is_a_503(qwen3_tokenizer_dir: Path) -> None:
    admission = Admission(max_concurrency=1, max_queue=4, queue_timeout_s=0.2)
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", backend_options={"itl_ms": 50}) as (engine, _),
        gateway_server(qwen3_tokenizer_dir, engine, admission=admission) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        first = asyncio.ensure_future(_stream_all(client))
        await asyncio.sleep(0.1)
        with pytest.raises(openai.InternalServerError, match=r"no slot within 0\.2 s"):
            await _stream_all(client)
        await first


@pytest.mark.parametrize(
    ("limits", "request_fields", "param"),
    [
        (Limits(max_tokens=64), {"max_tokens": 65}, "max_tokens"),
        (Limits(max_tokens=64), {"max_completion_tokens": 100}, "max_completion_tokens"),
        (Limits(max_n=2), {"n": 3}, "n"),
        (Limits(max_messages=1), {"messages": MESSAGES * 2}, "messages"),
    ],
)
async def test_operator_limits_are_400s_naming_the_field(
    qwen3_tokenizer_dir: Path, limits: Limits, request_fields: dict[str, object], param: str
) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine, _),
        gateway_server(qwen3_tokenizer_dir, engine, limits=limits) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        body = {"model": "sim", "messages": MESSAGES, **request_fields}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**body)  # type: ignore[call-overload]
        assert caught.value.body["param"] == param  # type: ignore[index]
        ok = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
        assert (await client.chat.completions.create(**ok)).choices  # type: ignore[call-overload]


async def test_completion_prompt_count_limit(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine, _),
        gateway_server(qwen3_tokenizer_dir, engine, limits=Limits(max_prompts=2)) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError, match="at most 2"):
            await client.completions.create(model="sim", prompt=["a", "b", "c"], max_tokens=2)
        answer = await client.completions.create(model="sim", prompt=[1, 2, 3, 4], max_tokens=2)  # one token prompt
        assert len(answer.choices) == 1


async def test_api_keys_from_a_file_reload_and_the_environment(
    qwen3_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team a\nkey-one\n\n")
    monkeypatch.setenv("ONEHOP_TEST_KEYS", "env-key, other-env-key")
    auth = Auth(api_keys_file=str(keys), api_keys_env="ONEHOP_TEST_KEYS", protect_metrics=True, poll_s=0.05)
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine, _),
        gateway_server(qwen3_tokenizer_dir, engine, auth=auth) as (base, state),
    ):

        async def models(key: str) -> int:
            async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
                try:
                    await client.models.list()
                except openai.AuthenticationError as exc:
                    assert exc.code == "invalid_api_key" and exc.type == "invalid_request_error"
                    return 401
                return 200

        assert [await models(k) for k in ("key-one", "env-key", "other-env-key", "nope", "key-on")] == [200, 200, 200, 401, 401]
        async with aiohttp.ClientSession() as session:
            root = base.removesuffix("/v1")
            async with session.get(root + "/metrics") as resp:
                assert resp.status == 401
            async with session.get(root + "/metrics", headers={"Authorization": "Bearer key-one"}) as resp:
                assert resp.status == 200
            async with session.get(root + "/health") as resp:
                assert resp.status == 200  # probes need no key
            async with session.post(base + "/chat/completions", json={"model": "sim", "messages": MESSAGES}) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["message"].startswith("missing API key")

        # Rotate: the new file replaces the old keys once the watcher sees it.
        replacement = tmp_path / "keys.new"
        replacement.write_text("key-two\n")
        replacement.rename(keys)
        deadline = time.monotonic() + 5
        while await models("key-two") != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await models("key-two") == 200 and await models("key-one") == 401
        # A broken file keeps the last good keys.
        keys.write_text("\n# nothing\n")
        deadline = time.monotonic() + 5
        while state.key_file is not None and state.key_file.rejected == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await models("key-two") == 200
        # So does a file that is not even text; and the watcher goes on: a later good file
        # is loaded, and the key it no longer holds is revoked.
        assert state.key_file is not None
        rejected = state.key_file.rejected
        keys.write_bytes(b"\xff\xfe key-\x80\n")
        deadline = time.monotonic() + 5
        while state.key_file.rejected == rejected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert state.key_file.rejected == rejected + 1 and await models("key-two") == 200
        replacement.write_text("key-three\n")
        replacement.rename(keys)
        deadline = time.monotonic() + 5
        while await models("key-three") != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await models("key-three") == 200 and await models("key-two") == 401


async def test_prompt_text_stays_out_of_the_logs(
    qwen3_tokenizer_dir: Path, unused_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "walrus-umbrella-7731"
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"my secret is {secret}"}]
    caplog.set_level("DEBUG")
    async with (
        gateway_server(qwen3_tokenizer_dir, f"http://127.0.0.1:{unused_tcp_port}") as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        with pytest.raises(openai.InternalServerError):  # no engine: 503, logged as a failure
            await client.chat.completions.create(model="sim", messages=messages, max_tokens=4)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="sim", messages=messages, max_tokens=4, n=99)
    assert caplog.records, "nothing was logged: the check would prove nothing"
    assert secret not in caplog.text
