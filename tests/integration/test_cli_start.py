"""`onehop` as its users first run it, in a subprocess: a start that cannot succeed ends at
once with one line on stderr, a non-zero status and no traceback (no model loaded first, no
worker restarted); `--help` shows the defaults; workers do not outlive their supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.support.engine import engine_server

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
START_S = 120
"""Bound on a command that must fail at start (it loads no model: a few seconds)."""


def _onehop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onehop", *args], cwd=ROOT, capture_output=True, text=True, timeout=START_S
    )


def _one_line_failure(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@contextmanager
def _taken_port() -> Iterator[int]:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield int(other.getsockname()[1])


def _gateway_config(tmp_path: Path, tokenizer: Path, **fields: object) -> Path:
    config = tmp_path / "gateway.yaml"
    settings = {"model": "qwen3", "tokenizer": str(tokenizer), "engines": [{"url": "http://127.0.0.1:9"}], "port": 0}
    config.write_text(yaml.safe_dump({**settings, **fields}))
    return config


def test_serve_with_a_missing_model_folder() -> None:
    _one_line_failure(_onehop("serve", "--model", "/nonexistent", "--port", "0"), "/nonexistent", "does not exist")


def test_engine_with_a_missing_model_folder() -> None:
    _one_line_failure(_onehop("engine", "--model", "/nonexistent", "--port", "0"), "/nonexistent", "does not exist")


def test_gateway_with_a_missing_config_file() -> None:
    _one_line_failure(_onehop("gateway", "--config", "/nonexistent.yaml"), "/nonexistent.yaml")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_example_config_names_its_missing_tokenizer_folder(tmp_path: Path, workers: str) -> None:
    """configs/gateway.yaml as shipped (a template: its folder is /models/Qwen3-8B), on a free port."""
    config = yaml.safe_load((ROOT / "configs" / "gateway.yaml").read_text())
    copy = tmp_path / "gateway.yaml"
    copy.write_text(yaml.safe_dump({**config, "host": "127.0.0.1", "port": 0}))
    result = _onehop("gateway", "--config", str(copy), "--workers", workers)
    _one_line_failure(result, "tokenizer folder /models/Qwen3-8B does not exist")


def test_an_engine_url_without_a_scheme(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    config = _gateway_config(tmp_path, qwen3_tokenizer_dir, engines=[{"url": "decode-0:8000"}])
    _one_line_failure(_onehop("gateway", "--config", str(config)), "decode-0:8000", "http://")


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_serve_and_engine_on_a_port_in_use(command: str) -> None:
    # No --model: the tiny model is not even built when the port is taken.
    with _taken_port() as port:
        _one_line_failure(_onehop(command, "--port", str(port)), f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_gateway_on_a_port_in_use(tmp_path: Path, qwen3_tokenizer_dir: Path, workers: str) -> None:
    with _taken_port() as port:
        config = _gateway_config(tmp_path, qwen3_tokenizer_dir, port=port)
        result = _onehop("gateway", "--config", str(config), "--workers", workers)
        _one_line_failure(result, f"127.0.0.1:{port}", "in use")


def _options(help_text: str) -> dict[str, str]:
    """Each option's help, by its first flag (argparse indents options by two spaces and wraps)."""
    options: dict[str, str] = {}
    current = ""
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            options[current] = line
        elif current and line.startswith("    "):
            options[current] += " " + line.strip()
        else:
            current = ""
    return {flag: " ".join(text.split()) for flag, text in options.items()}


@pytest.mark.parametrize("command", ["serve", "engine", "gateway", "fixtures"])
def test_help_shows_every_options_default(command: str) -> None:
    result = _onehop(command, "--help")
    assert result.returncode == 0
    options = _options(result.stdout)
    assert "--help" not in options and len(options) > 1, result.stdout
    for flag, text in options.items():
        if flag != "-h":
            assert "default" in text or "required" in text, text
    if command in ("serve", "engine"):
        assert "(default: 127.0.0.1)" in options["--host"]


async def test_a_worker_config_error_ends_the_gateway_once(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    """The engine serves `sim`, the config says `qwen3`: only a worker can tell (it asks the
    engine), every worker would fail alike, so the gateway stops with the message once."""
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        config = _gateway_config(tmp_path, qwen3_tokenizer_dir, engines=[{"url": engine_url}])
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "onehop", "gateway", "--config", str(config), "--workers", "2",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), START_S)
    stderr = err.decode()
    assert process.returncode == 2, stderr
    assert "Traceback" not in stderr + out.decode()
    assert "starting it again" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("onehop gateway:")]
    assert len(errors) == 1 and "serves model 'sim'" in errors[0], stderr


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie serves nothing


async def _both_workers_answer(base: str, supervisor: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_S
    seen: set[str] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        while seen != {"0", "1"}:
            assert supervisor.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, f"both workers did not answer (saw {seen})"
            try:
                async with session.get(base + "/health") as response:
                    seen.add(response.headers["onehop-worker"])
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@SLOW
async def test_workers_exit_when_their_supervisor_is_killed(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    config = _gateway_config(tmp_path, qwen3_tokenizer_dir, port=port)
    command = [sys.executable, "-m", "onehop", "gateway", "--config", str(config), "--workers", "2"]
    supervisor = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    workers: set[int] = set()
    try:
        await _both_workers_answer(f"http://127.0.0.1:{port}", supervisor)
        workers = _children(supervisor.pid)
        assert len(workers) == 2
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {[p for p in workers if _alive(p)]} outlived their supervisor"
            await asyncio.sleep(0.1)
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
