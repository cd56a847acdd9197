"""Helpers for the vLLM-marked tests: find vLLM's venv, run servers from it on loopback.

The tests run in the project's venv; only subprocesses run in vLLM's (made by
`scripts/setup_vllm.sh`), found as `$ONEHOP_VLLM_PYTHON`, else
`${ONEHOP_VLLM_VENV:-~/.cache/onehop/vllm-venv}/bin/python`. Without it every
test here is skipped with a reason that says how to get it.

Each server runs in its own process group (vLLM forks an engine core and a
worker), so stopping it kills the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest

ROOT = Path(__file__).resolve().parents[2]
# vLLM on CPU is ready in ~30-45 s; two starting at once on two cores take longer.
READY_TIMEOUT_S = 240.0
READY_POLL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_BYTES = 6000
SKIP_REASON = (
    "vLLM conformance SKIPPED: no vLLM venv python at {path}; "
    "run scripts/setup_vllm.sh or set ONEHOP_VLLM_PYTHON"
)


def vllm_python_path() -> Path:
    """Where vLLM's venv python should be (it may not exist)."""
    configured = os.environ.get("ONEHOP_VLLM_PYTHON")
    if configured:
        return Path(configured)
    venv = os.environ.get("ONEHOP_VLLM_VENV") or str(Path.home() / ".cache" / "onehop" / "vllm-venv")
    return Path(venv) / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    path = vllm_python_path()
    if not os.access(path, os.X_OK):
        reason = SKIP_REASON.format(path=path)
        # Loud in the log as well as in the summary: a silent skip would read as a pass.
        print(f"\n*** {reason} ***", file=sys.stderr)
        pytest.skip(reason)
    return path


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess in vLLM's venv: offline, small KV cache, repo importable."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: BinaryIO
    started: float
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        self.log.flush()
        self.log.seek(0, os.SEEK_END)
        size = self.log.tell()
        self.log.seek(max(0, size - LOG_TAIL_BYTES))
        return self.log.read().decode("utf-8", "replace")


def start_server(name: str, argv: Sequence[str], port: int, env: Mapping[str, str]) -> Server:
    """Start `argv` in a new process group, its output in a temporary log."""
    # Closed by stop_server: the log lives as long as the server.
    log = tempfile.TemporaryFile(prefix=f"onehop-{name}-")  # noqa: SIM115
    proc = subprocess.Popen(
        list(argv),
        cwd=ROOT,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Server(name=name, proc=proc, port=port, log=log, started=time.monotonic())


def wait_ready(server: Server, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll `/health` until 200; fail with the server's log if it dies or the wait runs out."""
    deadline = server.started + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        if _healthy(server.url):
            server.ready_s = round(time.monotonic() - server.started, 1)
            print(f"\n{server.name} ready on :{server.port} in {server.ready_s} s", file=sys.stderr)
            return
        time.sleep(READY_POLL_S)
    pytest.fail(f"{server.name} not ready after {timeout_s:.0f} s:\n{server.log_tail()}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop_server(server: Server) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers, close its log."""
    stopping = time.monotonic()
    try:
        _signal_group(server.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=STOP_TIMEOUT_S)
        graceful = server.proc.returncode is not None
        # vLLM's engine core and workers are in the group too; none may outlive the test.
        _signal_group(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=STOP_TIMEOUT_S)
        how = "" if graceful else f" (SIGKILL: no exit {STOP_TIMEOUT_S:.0f} s after SIGTERM)"
        print(f"\n{server.name} stopped in {time.monotonic() - stopping:.1f} s{how}", file=sys.stderr)
    finally:
        server.log.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def servers(specs: Sequence[tuple[str, Sequence[str], int]], env: Mapping[str, str]) -> Iterator[list[Server]]:
    """Start every (name, argv, port) at once, wait until all are ready, stop all on exit."""
    started: list[Server] = []
    try:
        for name, argv, port in specs:
            started.append(start_server(name, argv, port, env))
        for server in started:
            wait_ready(server)
        yield started
    finally:
        for server in started:
            stop_server(server)


def post(url: str, body: bytes, timeout_s: float = 120.0) -> tuple[int, bytes]:
    """POST JSON; returns (status, body) for error statuses too."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), bytes(exc.read())


def sse_payloads(body: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, without `[DONE]`; comments are skipped."""
    payloads: list[bytes] = []
    for event in body.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                payloads.append(line[len(b"data: ") :])
    return payloads


def has_done(body: bytes) -> bool:
    return b"data: [DONE]\n\n" in body


def chat_prompt_ids(tokenizer: Any, content: str, *, enable_thinking: bool = True) -> list[int]:
    """A user turn rendered with the model's chat template, as token ids."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
