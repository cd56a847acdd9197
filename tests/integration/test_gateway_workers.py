"""`onehop gateway --workers 2`: a real supervisor and two worker processes on one port,
in front of a real sim engine (and, sharing state, a real `redis-server`). Every request goes on a new connection, so the kernel's
SO_REUSEPORT hashing picks a worker each time (40 requests all on one worker: 2^-39), except
where a test keeps one connection alive on purpose."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.render.local import LocalRenderer
from tests.support.engine import engine_server
from tests.support.redis_server import redis_server
from tests.support.ports import free_port
from wire.openai_schema import ChatCompletionRequest

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

REQUESTS = 40
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}



@asynccontextmanager
async def _workers(config: Path, log: Path) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    port = yaml.safe_load(config.read_text())["port"]
    command = [sys.executable, "-m", "onehop", "gateway", "--config", str(config), "--workers", "2"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        await _until_both_ready(base, process, log)
        yield base, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def _until_both_ready(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while seen != {"0", "1"}:
        assert process.poll() is None, f"the gateway exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"both workers did not answer within 120 s (saw {seen}):\n{log.read_text()}"
        try:
            seen |= {header for header in await _fresh(base, "GET", "/health", count=8) if header is not None}
        except aiohttp.ClientError:
            await asyncio.sleep(0.3)


async def _fresh(base: str, method: str, path: str, *, count: int, key: str | None = None, body: object = None,
                 want: int = 200) -> list[str | None]:
    """`count` requests, each on its own connection; the worker that answered each."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    workers: list[str | None] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(count):
            async with session.request(method, base + path, json=body, headers=headers) as response:
                await response.read()
                assert response.status == want, (path, response.status)
                workers.append(response.headers.get("onehop-worker"))
    return workers


def _requests_total(text: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_requests":
            total += sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["endpoint"] == "chat")
    return total


async def test_two_workers_share_the_port_the_metrics_the_reload_and_the_store(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("old-key\nteam team-key\n")
    config = tmp_path / "gateway.yaml"
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        config.write_text(yaml.safe_dump({
            "model": "sim", "tokenizer": str(qwen3_tokenizer_dir), "engines": [{"url": engine_url}],
            "host": "127.0.0.1", "port": free_port(),
            # Only SIGHUP reloads the key file within the test's time.
            "auth": {"api_keys_file": str(keys), "poll_s": 3600},
        }))
        async with _workers(config, tmp_path / "gateway.log") as (base, process):
            # Requests spread over both processes.
            served = await _fresh(base, "POST", "/v1/chat/completions", count=REQUESTS, key="old-key", body=CHAT)
            assert set(served) == {"0", "1"}

            # One scrape, whichever worker answers it, counts every worker's requests.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                for _ in range(4):
                    async with session.get(base + "/metrics") as response:
                        assert _requests_total(await response.text()) == REQUESTS

            # A stored response is found by either worker, by its own caller only.
            async with aiohttp.ClientSession() as session, session.post(
                base + "/v1/responses", json={"model": "sim", "input": "hi", "max_output_tokens": 4},
                headers={"Authorization": "Bearer old-key"},
            ) as response:
                assert response.status == 200, await response.text()
                stored = (await response.json())["id"]
            found = await _fresh(base, "GET", f"/v1/responses/{stored}", count=16, key="old-key")
            assert set(found) == {"0", "1"}
            # Another key's caller finds it in neither worker.
            hidden = await _fresh(base, "GET", f"/v1/responses/{stored}", count=16, key="team-key", want=404)
            assert set(hidden) == {"0", "1"}

            # SIGHUP to the supervisor reloads the key file in both workers.
            keys.write_text("new-key\n")
            process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while True:
                try:
                    answered = await _fresh(base, "GET", "/v1/models", count=16, key="new-key")
                    break
                except AssertionError:
                    assert time.monotonic() < deadline, "the new key was not accepted by every worker within 20 s"
                    await asyncio.sleep(0.2)
            assert set(answered) == {"0", "1"}
            refused = await _fresh(base, "GET", "/v1/models", count=16, key="old-key", want=401)
            assert set(refused) == {"0", "1"}

            # SIGTERM stops both workers, then the supervisor, and frees the port.
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", int(base.rsplit(":", 1)[1]))) != 0


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


async def _turn(base: str, previous: str | None) -> tuple[str, str | None]:
    """One Responses turn on a fresh connection, continuing `previous`: its id and the worker."""
    body: dict[str, object] = {"model": "sim", "input": "and then?", "max_output_tokens": 4}
    if previous is not None:
        body["previous_response_id"] = previous
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.post(base + "/v1/responses", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return (await response.json())["id"], response.headers.get("onehop-worker")


@SLOW
async def test_a_conversation_crosses_workers_and_a_killed_worker_comes_back(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        config.write_text(yaml.safe_dump({
            "model": "sim", "tokenizer": str(qwen3_tokenizer_dir), "engines": [{"url": engine_url}],
            "host": "127.0.0.1", "port": free_port(),
        }))
        async with _workers(config, tmp_path / "gateway.log") as (base, process):
            # Each turn names the one before; the kernel picks the worker of each connection.
            previous, workers = None, set()
            for _ in range(12):
                previous, worker = await _turn(base, previous)
                workers.add(worker)
            assert workers == {"0", "1"}

            served = await _fresh(base, "POST", "/v1/chat/completions", count=10, body=CHAT)
            victim = min(_children(process.pid))
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while victim in _children(process.pid) or len(_children(process.pid)) < 2:
                assert time.monotonic() < deadline, "the killed worker was not started again"
                await asyncio.sleep(0.2)  # until the supervisor reaped it and started another
            await _until_both_ready(base, process, tmp_path / "gateway.log")
            served += await _fresh(base, "POST", "/v1/chat/completions", count=10, body=CHAT)
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
                session.get(base + "/metrics") as response,
            ):
                # The dead worker's requests stay counted; the new one's are added.
                assert _requests_total(await response.text()) == len(served)
            process.send_signal(signal.SIGTERM)  # the replacement drains and stops like the first ones
            assert await asyncio.to_thread(process.wait, 60) == 0


@SLOW
def test_workers_that_keep_dying_make_the_supervisor_give_up(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Workers that die at once for a reason other than their config (here: each exits 3 as
    its interpreter starts) end the supervisor with status 1 after a few restarts, rather
    than restarting forever. (A config error stops it at once: tests/integration/test_cli_start.py.)"""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif 'ONEHOP_GATEWAY_WORKER' in os.environ:\n    os._exit(3)\n"
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "model": "sim", "tokenizer": str(qwen3_tokenizer_dir), "engines": [{"url": "http://127.0.0.1:9"}],
        "host": "127.0.0.1", "port": free_port(),
    }))
    command = [sys.executable, "-m", "onehop", "gateway", "--config", str(config), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run(command, capture_output=True, timeout=120, env=env)
    assert process.returncode == 1, process.stderr.decode()[-2000:]
    assert b"exited with 3" in process.stderr and b"giving up" in process.stderr


async def _chat_tokens(base: str, key: str) -> tuple[int, int, str | None]:
    """One small chat on a fresh connection: status, the tokens its usage says, the worker."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.post(base + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}) as response,
    ):
        body = await response.json()
        tokens = body["usage"]["total_tokens"] if response.status == 200 else 0
        return response.status, tokens, response.headers.get("onehop-worker")


async def test_two_worker_processes_sharing_redis_hold_one_quota_and_one_response_store(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Two OS processes (the kernel spreads connections over them) and one `redis-server`:
    a tenant's tokens_per_minute holds across both within one request's size, and a stored
    Response is continued through either and is a 404 for another tenant through either."""
    quota = 300
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha\nbeta key-beta\n")
    config = tmp_path / "gateway.yaml"
    async with redis_server(tmp_path) as server, engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        config.write_text(yaml.safe_dump({
            "model": "sim", "tokenizer": str(qwen3_tokenizer_dir), "engines": [{"url": engine_url}],
            "host": "127.0.0.1", "port": free_port(), "auth": {"api_keys_file": str(keys)},
            "state": {"backend": "redis", "url": server.url}, "tenants": {"alpha": {"tokens_per_minute": quota}},
        }))
        async with _workers(config, tmp_path / "gateway.log") as (base, _):
            started = time.monotonic()
            answers = []
            for _ in range(8):  # 4 at once until well past the quota
                answers += await asyncio.gather(*(_chat_tokens(base, "key-alpha") for _ in range(4)))
            elapsed = time.monotonic() - started
            assert {worker for status, _, worker in answers if status == 200} == {"0", "1"}
            assert {status for status, _, _ in answers} == {200, 429}
            admitted = sum(tokens for _, tokens, _ in answers)
            largest = max(tokens for _, tokens, _ in answers)
            assert quota - largest <= admitted <= quota + quota * elapsed / 60 + largest, (admitted, largest)

            async with aiohttp.ClientSession() as session, session.post(
                base + "/v1/responses", json={"model": "sim", "input": "hi", "max_output_tokens": 4},
                headers={"Authorization": "Bearer key-beta"},
            ) as response:
                assert response.status == 200, await response.text()
                stored = (await response.json())["id"]
            found = await _fresh(base, "GET", f"/v1/responses/{stored}", count=12, key="key-beta")
            hidden = await _fresh(base, "GET", f"/v1/responses/{stored}", count=12, key="key-alpha", want=404)
            assert set(found) == set(hidden) == {"0", "1"}
            continued = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                for _ in range(8):
                    async with session.post(
                        base + "/v1/responses", headers={"Authorization": "Bearer key-beta"},
                        json={"model": "sim", "input": "more", "max_output_tokens": 4, "previous_response_id": stored},
                    ) as response:
                        assert response.status == 200, await response.text()
                        continued.append(response.headers.get("onehop-worker"))
            assert set(continued) == {"0", "1"}


def _turns(topic: str, count: int) -> Iterator[dict[str, object]]:
    """The chat bodies of one conversation of `count` turns, each adding a few hundred tokens."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You review {topic}. " + "Be brief. " * 30}]
    for turn in range(count):
        words = " ".join(f"{topic}{turn}x{index}" for index in range(60))
        messages.append({"role": "user", "content": f"Turn {turn} of the {topic} review: {words}"})
        yield {"model": "sim", "messages": list(messages), "max_tokens": 2}
        messages.append({"role": "assistant", "content": f"Noted {topic} {turn}: " + "fine. " * 40})


def _prompt_tokens(tokenizer_dir: Path, bodies: list[dict[str, object]]) -> list[int]:
    """Each body's prompt length rendered here with no cache at all: what either worker must send."""
    renderer = LocalRenderer(tokenizer_dir, workers=1, cache_bytes=0)
    try:
        return [len(renderer.chat_sync(msgspec.convert(body, ChatCompletionRequest))) for body in bodies]
    finally:
        renderer.close()


async def _cache_tokens(base: str) -> tuple[float, float]:
    """(hit, miss) of `onehop_gateway_render_cache_tokens_total`, summed over both workers."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.get(base + "/metrics") as response,
    ):
        text = await response.text()
    counts = {"hit": 0.0, "miss": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_render_cache_tokens":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["result"]] += sample.value
    return counts["hit"], counts["miss"]


async def _chat(session: aiohttp.ClientSession, base: str, body: dict[str, object]) -> tuple[int, str]:
    """One turn: the prompt tokens the engine was sent, and the worker that rendered them."""
    async with session.post(base + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        usage = (await response.json())["usage"]
        return usage["prompt_tokens"], response.headers["onehop-worker"]


async def test_a_conversation_keeps_its_worker_on_one_connection_and_pays_only_unseen_turns_on_new_ones(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Issue #32 item 3. Each worker has its own turn cache. (i) An agent that keeps its
    connection alive between turns stays on one worker, which tokenizes only each turn's new
    messages; (ii) a client that opens a new connection per turn lands on either worker, and a
    worker tokenizes only the turns it has not seen since it last served the conversation.
    Either way the engine is sent the same prompts as a render with no cache."""
    kept_bodies, fresh_bodies = list(_turns("parser", 12)), list(_turns("scheduler", 24))
    kept_expected = _prompt_tokens(qwen3_tokenizer_dir, kept_bodies)
    fresh_expected = _prompt_tokens(qwen3_tokenizer_dir, fresh_bodies)
    config = tmp_path / "gateway.yaml"
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        config.write_text(yaml.safe_dump({
            "model": "sim", "tokenizer": str(qwen3_tokenizer_dir), "engines": [{"url": engine_url}],
            "host": "127.0.0.1", "port": free_port(),
        }))
        async with _workers(config, tmp_path / "gateway.log") as (base, _):
            # (i) One kept-alive connection: one worker; every earlier turn comes from its cache.
            workers = set()
            async with aiohttp.ClientSession() as session:
                for turn, body in enumerate(kept_bodies):
                    hit, miss = await _cache_tokens(base)
                    prompt, worker = await _chat(session, base, body)
                    workers.add(worker)
                    after_hit, after_miss = await _cache_tokens(base)
                    assert prompt == kept_expected[turn]
                    earlier = kept_expected[turn - 1] if turn else 0
                    assert (after_hit - hit, after_miss - miss) == (earlier, prompt - earlier), turn
            assert len(workers) == 1

            # (ii) A new connection per turn: both workers; each pays the turns new to it.
            last_seen: dict[str, int] = {}
            for turn, body in enumerate(fresh_bodies):
                hit, miss = await _cache_tokens(base)
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                    prompt, worker = await _chat(session, base, body)
                after_hit, after_miss = await _cache_tokens(base)
                assert prompt == fresh_expected[turn]
                seen = last_seen.get(worker)
                unseen = prompt - (fresh_expected[seen] if seen is not None else 0)
                assert after_hit - hit + after_miss - miss == prompt, turn
                assert after_miss - miss <= unseen, (turn, worker, seen)
                if seen is not None:  # exactly the turns since: the rest of the prompt is in its cache
                    assert after_miss - miss == unseen, (turn, worker, seen)
                last_seen[worker] = turn
            assert set(last_seen) == {"0", "1"}
