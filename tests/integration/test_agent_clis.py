"""Real coding-agent CLIs through onehop: Codex CLI (`codex exec`, Responses API) and Claude
Code (`claude -p`, Messages API) with their default settings, against `onehop gateway` with
API keys on, in front of a sim engine in agent mode.

Each run is one whole tool loop: the model (the sim) calls the CLI's shell tool, the CLI runs
the command, sends its output back, and the model's final answer names what the command
printed, which the CLI writes to stdout. The command prints a marker that is not in its own
text, so the marker on stdout came from running it. Once per tool-call format: Hermes,
`qwen3_coder`, and Harmony (gpt-oss).

The CLIs are the versions pinned in `tools/agents/package-lock.json`, installed by
`npm ci --prefix tools/agents` (`.ci/run` does it); without that folder these tests skip and
say so. Each CLI runs with a fresh HOME, its usual key variable, and its telemetry, error
reports and update checks off, so nothing leaves the machine. Engine, gateway and CLIs are
separate processes, as users run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from engine.qwen3.fixtures import cache_dir, ensure_tokenizer
from tests.support import harmony_tokenizer
from tests.support.family_tokenizers import build_family_tokenizer
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
AGENT_BIN = ROOT / "tools" / "agents" / "node_modules" / ".bin"
CODEX = AGENT_BIN / "codex"
CLAUDE = AGENT_BIN / "claude"

MARKER = "onehop-agent-OK"
COMMAND = "printf '%s-%s\\n' onehop agent-OK"  # prints MARKER; its text does not hold it
PROMPT = "Run the command that prints the marker, then tell me what it printed."
AGENT_CALLS = {
    "exec_command": {"cmd": COMMAND},  # Codex's shell tool
    "Bash": {"command": COMMAND, "description": "Print the marker"},  # Claude Code's
}
KEY = "onehop-agent-test-key"
KEYS_ENV = "ONEHOP_AGENT_TEST_KEYS"
CODEX_MODEL = "onehop-agent"
CLAUDE_MODELS = ["claude-*"]
"""Claude Code's names (`claude-opus-4-8`, ... new ones every release) as one glob alias."""

# tool parser -> (reasoning parser, marker tokens added to the Qwen3 tokenizer). The chat
# template stays Qwen3's, so the sim reads every prompt the same way; the output format differs.
FORMATS: dict[str, tuple[str, tuple[tuple[str, bool], ...]]] = {
    "hermes": ("qwen3", ()),
    "qwen3_coder": ("qwen3", ()),
    "openai": ("openai_gptoss", tuple((text, True) for text in harmony_tokenizer.MARKERS)),
}
START_S = 60
RUN_S = 60
"""Bound on one CLI run: each takes seconds, but a CLI retries what the gateway refuses."""

REQUIRED_ENV = "ONEHOP_REQUIRE_AGENT_CLIS"
"""Set (by .ci/run): a missing install fails these tests instead of skipping them."""

if not (CODEX.exists() and CLAUDE.exists()):
    _MISSING = "the agent CLIs are not installed: run `npm ci --prefix tools/agents` (.ci/run does)"
    if os.environ.get(REQUIRED_ENV):
        pytest.fail(f"{REQUIRED_ENV} is set but {_MISSING}", pytrace=False)
    pytest.skip(_MISSING, allow_module_level=True)


@dataclass(frozen=True)
class Onehop:
    url: str
    """The gateway's base URL, without `/v1`."""
    log: Path
    """The engine's and the gateway's stderr."""



def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url} exited with {process.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up within {START_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Path]:
    qwen3 = ensure_tokenizer()
    return {
        name: build_family_tokenizer(cache_dir(), f"e2e-{name}", list(added)) if added else qwen3
        for name, (_, added) in FORMATS.items()
    }


@pytest.fixture(scope="module", params=list(FORMATS))
def onehop(
    request: pytest.FixtureRequest, tokenizers: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Onehop]:
    """A sim engine in agent mode and `onehop gateway` in front of it (API keys on), as processes."""
    tool_parser = request.param
    reasoning_parser = FORMATS[tool_parser][0]
    folder = tokenizers[tool_parser]
    tmp = tmp_path_factory.mktemp(f"onehop-{tool_parser}")
    log = tmp / "servers.log"
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    config = {
        "host": "127.0.0.1",
        "port": gateway_port,
        "models": [
            {
                "name": CODEX_MODEL,
                "aliases": CLAUDE_MODELS,
                "tokenizer": str(folder),
                "engines": [{"url": engine_url}],
                "reasoning_parser": reasoning_parser,
                "tool_parser": tool_parser,
            }
        ],
        "auth": {"api_keys_env": KEYS_ENV},
    }
    (tmp / "gateway.yaml").write_text(yaml.safe_dump(config))
    options = {"mode": "agent", "agent_calls": AGENT_CALLS}
    engine_command = [
        sys.executable, "-m", "onehop", "engine", "--backend", "sim", "--model", str(folder),
        "--served-model-name", CODEX_MODEL, "--port", str(engine_port),
        "--reasoning-parser", reasoning_parser, "--tool-parser", tool_parser,
        *(f"--backend-option={key}={json.dumps(value)}" for key, value in options.items()),
    ]  # fmt: skip
    gateway_command = [sys.executable, "-m", "onehop", "gateway", "--config", str(tmp / "gateway.yaml")]
    gateway_command += ["--workers", "1"]
    env = {**os.environ, KEYS_ENV: KEY}
    with log.open("wb") as sink:
        engine = subprocess.Popen(engine_command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        gateway: subprocess.Popen[bytes] | None = None
        try:
            _wait_healthy(engine_url, engine, log)
            gateway = subprocess.Popen(gateway_command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
            _wait_healthy(gateway_url, gateway, log)
            yield Onehop(gateway_url, log)
        finally:
            for process in (gateway, engine):
                if process is not None:
                    process.terminate()
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()


def _home(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh HOME, and a work folder inside a git repository (Codex's default requirement)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    return home, work


def _base_env(home: Path) -> dict[str, str]:
    """Only what a CLI needs: no proxy, provider or key variables inherited from the test run."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}


def codex_config(base_url: str, model: str) -> str:
    """Codex's config.toml for onehop: a provider with the Responses wire API, and its
    analytics, feedback uploads, OpenTelemetry export and update check off. No feature flag
    is touched. (The "Coding agents" section of docs/gateway.md shows the same file.)"""
    return f"""\
model = "{model}"
model_provider = "onehop"
check_for_update_on_startup = false

[model_providers.onehop]
name = "onehop"
base_url = "{base_url}/v1"
env_key = "OPENAI_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"
"""


CLAUDE_QUIET = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}
"""Claude Code's telemetry, error reports, update checks and other non-essential traffic off."""


def _servers_log(server: Onehop) -> str:
    """The servers' log without the health checks and metric scrapes between the requests."""
    lines = server.log.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if '"GET /health' not in line and '"GET /metrics' not in line)[-6000:]


def _outputs(stdout: str | bytes | None, stderr: str | bytes | None, server: Onehop) -> str:
    return f"stdout:\n{stdout!s}\nstderr:\n{str(stderr)[-6000:]}\nservers:\n{_servers_log(server)}"


def _run(command: list[str], env: dict[str, str], cwd: Path, server: Onehop) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command[0]} ran past {RUN_S} s\n{_outputs(exc.stdout, exc.stderr, server)}")
    print(f"{Path(command[0]).name}: {time.monotonic() - started:.1f} s")
    failure = f"exit {result.returncode}\n{_outputs(result.stdout, result.stderr, server)}"
    assert result.returncode == 0, failure
    assert MARKER in result.stdout, failure
    return result


def test_codex_exec_runs_a_shell_command_through_onehop(onehop: Onehop, tmp_path: Path) -> None:
    home, work = _home(tmp_path)
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(onehop.url, CODEX_MODEL))
    env = {**_base_env(home), "CODEX_HOME": str(codex_home), "OPENAI_API_KEY": KEY}
    _run([str(CODEX), "exec", PROMPT], env, work, onehop)


def test_claude_code_runs_a_shell_command_through_onehop(onehop: Onehop, tmp_path: Path) -> None:
    home, work = _home(tmp_path)
    env = {**_base_env(home), **CLAUDE_QUIET, "ANTHROPIC_BASE_URL": onehop.url, "ANTHROPIC_API_KEY": KEY}
    # No permission flag: `printf` is one of the read-only commands Claude Code runs without
    # asking, so the default permission mode runs it in -p mode (which cannot ask).
    _run([str(CLAUDE), "-p", PROMPT], env, work, onehop)



def test_the_docs_show_the_settings_tested_here() -> None:
    page = (ROOT / "docs" / "gateway.md").read_text(encoding="utf-8")
    section = page.split("\n## Coding agents\n", 1)[1].split("\n## ", 1)[0]
    assert codex_config("http://gateway-host:8000", "Qwen/Qwen3.6-35B-A3B") in section
    for name in CLAUDE_QUIET:
        assert f"{name}=1" in section
    assert "ANTHROPIC_BASE_URL=http://gateway-host:8000\n" in section
