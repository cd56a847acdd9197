"""The gateway process loads neither torch nor transformers, and idles small.

Both run in a fresh interpreter: this test process has transformers loaded for
other tests, so only a child can say what the gateway alone pulls in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.ports import free_port

IDLE_RSS_BOUND_MIB = 150
"""Measured 109.7 MiB on the Qwen3 tokenizer (554.7 MiB with transformers loaded)."""
START_TIMEOUT_S = 60.0

_GATEWAY_PATH = """
import asyncio, json, sys
import gateway.serving.app
after_import = sorted(m for m in ("torch", "transformers") if m in sys.modules)

import aiohttp
from aiohttp import web
from gateway.config import EngineEndpoint, GatewayConfig

async def main():
    config = GatewayConfig(model="m", tokenizer=sys.argv[1], engines=[EndpointUrl], route_header=True)
    runner = web.AppRunner(gateway.serving.app.create_app(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/messages/count_tokens", json={"model": "m", "messages": chat["messages"]}) as answer:
            counted = (answer.status, await answer.json())
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as answer:
            await answer.read()
    await runner.cleanup()
    return counted

counted = asyncio.run(main())
print(json.dumps({"after_import": after_import, "after_start": sorted(m for m in ("torch", "transformers") if m in sys.modules), "counted": counted}))
"""


def test_the_gateway_path_imports_neither_torch_nor_transformers(qwen3_tokenizer_dir: Path) -> None:
    """Import, start (render, vocabulary, parser resolution, config), count tokens and render a chat."""
    code = _GATEWAY_PATH.replace("EndpointUrl", f"EngineEndpoint(url='http://127.0.0.1:{free_port()}')")
    done = subprocess.run([sys.executable, "-c", code, str(qwen3_tokenizer_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == [] and seen["after_start"] == []
    status, body = seen["counted"]
    assert status == 200 and body["input_tokens"] > 0, body  # the chat was rendered


def test_importing_the_gateway_app_loads_neither() -> None:
    code = "import gateway.serving.app, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    """The gateway listens only once every model is loaded, so the first answer means ready."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the gateway exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise AssertionError(f"the gateway was not ready within {START_TIMEOUT_S} s")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_an_idle_gateway_stays_under_its_memory_bound(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    """`onehop gateway` on the Qwen3 tokenizer, one model, ready and idle: resident memory bounded."""
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            model: qwen3
            tokenizer: {qwen3_tokenizer_dir}
            engines: [{{url: "http://127.0.0.1:{free_port()}"}}]
            port: {port}
            """),
        encoding="utf-8",
    )
    process = subprocess.Popen([sys.executable, "-m", "onehop", "gateway", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v1/models", process)
        assert _rss_mib(process.pid) < IDLE_RSS_BOUND_MIB
    finally:
        process.terminate()
        process.wait(timeout=30)
