"""Background loops keep running: the supervisor restarts a failed loop; feedback and file
watchers survive the engine or the file that broke them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import EngineEndpoint, Health
from gateway.routing.datastore import EndpointStore, Load
from gateway.routing.feedback import CPU_METRIC, KV_USAGE_METRIC, WAITING_METRIC, EngineFeedback
from gateway.serving.reload import WatchedFile
from gateway.serving.supervisor import Supervisor
from tests.support.waiting import wait_until


async def test_a_failing_loop_is_logged_counted_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    restarts: list[str] = []
    runs = 0
    third = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            third.set()
            await asyncio.sleep(3600)  # the third run lasts
        raise RuntimeError(f"run {runs} broke")

    supervisor = Supervisor(restarts.append, restart_s=0.01)
    supervisor.start("flaky", flaky)
    await asyncio.wait_for(third.wait(), timeout=5)
    await supervisor.stop()
    assert restarts == ["flaky", "flaky"]
    assert "background loop flaky failed" in caplog.text and "run 2 broke" in caplog.text


async def test_one_engine_answering_html_does_not_stop_the_others_feedback() -> None:
    cpu = 0.0

    async def good(request: web.Request) -> web.Response:
        nonlocal cpu
        cpu += 0.5
        return web.Response(
            text=f'{CPU_METRIC}{{mode="derender"}} {cpu}\n{WAITING_METRIC} 3\n{KV_USAGE_METRIC}{{engine="0"}} 0.25\n'
            + "".join(  # vLLM's info gauge, one series per data-parallel rank, each rank's own cache
                f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{rank}",'
                f'num_gpu_blocks="2048",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"}} 1.0\n'
                for rank in (0, 1)
            )
        )

    html_polls = 0

    async def html(request: web.Request) -> web.Response:
        nonlocal html_polls
        html_polls += 1
        return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")

    servers = []
    for handler in (html, good):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        servers.append(TestServer(app))
    for server in servers:
        await server.start_server()
    urls = [str(server.make_url("")).rstrip("/") for server in servers]
    store = EndpointStore([EngineEndpoint(url=url) for url in urls], Health())
    feedback = EngineFeedback(lambda: [store], 0.01)
    try:
        async with aiohttp.ClientSession() as session:
            run = asyncio.ensure_future(feedback.run(session))
            # The loop came back to the engine answering HTML after it broke, and kept reading the good one.
            await wait_until(lambda: html_polls >= 3 and cpu >= 1.5, what="three rounds of polls")
            assert not run.done(), "the feedback loop stopped"
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    finally:
        for server in servers:
            await server.close()
    good_load = store.endpoints[urls[1]].load
    assert good_load.output_cpu_cores > 0 and good_load.waiting == 3 and good_load.kv_usage == 0.25
    assert good_load.cache_blocks == 4096
    assert store.endpoints[urls[0]].load == Load()


def test_a_watched_file_keeps_its_last_good_value_whatever_breaks(tmp_path: Path) -> None:
    path = tmp_path / "value.txt"
    path.write_text("one\n")

    def load(p: Path) -> str:
        text = p.read_text(encoding="utf-8").strip()
        if not text:
            raise ValueError("empty")
        return text

    watched = WatchedFile(path, load, "value")
    assert watched.current == "one"
    for broken in (b"", b"\xff\xfe\x80", None):
        if broken is None:
            path.unlink()
        else:
            path.write_bytes(broken)
        assert watched.reload() is False and watched.current == "one"
    path.write_text("two\n")
    assert watched.reload() is True and watched.current == "two"
    assert watched.rejected == 3
