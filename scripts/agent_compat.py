"""Coding-agent compatibility beside vLLM: the real agent CLIs and a few single requests,
sent to stock vLLM's OpenAI server and to `onehop serve`, side by side, in one run.

Servers (each started here, stopped at the end):

- vLLM: vLLM 0.32's own OpenAI server (`scripts/vllm_serve.sh`: qwen3 reasoning parser,
  hermes tool parser, auto tool choice) with the tiny random Qwen3 model
  (`engine.qwen3.fixtures.ensure_tiny_model`), scripted by `scripts/vllm_agent_script.py`
  (a logits processor) to call each CLI's shell tool once and then answer with its output,
  the plan onehop's sim follows, so both servers get each CLI's whole tool loop (its tool
  results included), not just its first request. Its python is `--vllm-python`, else
  $ONEHOP_VLLM_PYTHON, else the last line of `bash scripts/setup_vllm.sh`. The model's
  context is raised to MAX_MODEL_LEN (the CLIs' first prompts are ~10-20k tokens, the
  model's own limit 4096), and it is served under the agent model name and Claude Code's
  default model names too, so neither a length nor a name refusal hides how vLLM reads the
  requests themselves.
- onehop: `onehop serve --backend sim` in agent mode (it calls each CLI's shell tool once,
  then answers with the tool's output) with the same Qwen3 tokenizer and parsers, and
  `--alias 'claude-*'`.

Clients, each run once per server through a logging reverse proxy (method, path, status and,
for a 4xx/5xx, the error message's first 200 characters), bounded by `--run-s` (a CLI
retries what a server refuses): Codex CLI (`codex exec`, Responses API) and Claude Code
(`claude -p`, Messages API), the versions pinned in tools/agents, with their default
settings exactly as tests/integration/test_agent_clis.py runs them (a fresh HOME, Codex's
config.toml with a custom provider on the Responses wire API, Claude Code pointed by
ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY; telemetry and update checks off).

Probes: single requests sent to each server directly (see PROBES), one status per server.

Prints a Markdown report on stdout (commit, machine, versions, the two tables); progress and
server logs' location on stderr.

    .venv/bin/python scripts/agent_compat.py [--run-s 90] [--vllm-python PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer  # noqa: E402

AGENT_BIN = ROOT / "tools" / "agents" / "node_modules" / ".bin"
if not ((AGENT_BIN / "codex").exists() and (AGENT_BIN / "claude").exists()):
    # Checked before the test module's import, which skips itself (a pytest exception) without them.
    sys.exit("the agent CLIs are not installed: run `npm ci --prefix tools/agents`")

# The CLIs' settings are the integration test's own, so this measures what the test runs.
from tests.integration.test_agent_clis import (  # noqa: E402
    AGENT_CALLS,
    CLAUDE,
    CLAUDE_QUIET,
    CODEX,
    MARKER,
    PROMPT,
    codex_config,
)

MODEL = "onehop-agent"
CLAUDE_NAMES = ["claude-opus-4-8", "claude-sonnet-5", "claude-haiku-4-5-20251001"]
"""Claude Code 2.1.197's default model names (main, and small/fast), served by vLLM as extra names."""
KEY = "agent-compat-key"
MAX_MODEL_LEN = 131072
MAX_NEW_TOKENS = 256
"""vLLM's hard cap on an answer's length, should a scripted turn not end (the CLIs ask up to 32000
tokens, ~100 tokens/s here)."""
START_S = 240
PROBE_S = 60
ERROR_CHARS = 200
HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "content-encoding"}
)
"""Headers the proxy does not pass on: hop-by-hop ones, and encodings (aiohttp's client decodes)."""
STREAM_ERROR = re.compile(rb"event: error|\"type\": ?\"(error|response\.failed)\"")
"""An error reported inside a 200 event stream (Anthropic's `error` event, Responses' `response.failed`)."""


@dataclass
class Record:
    method: str
    path: str
    status: int
    error: str = ""
    stream_error: bool = False


@dataclass
class Proxy:
    """A logging reverse proxy in front of one server; `records` is cleared per CLI run."""

    upstream: str
    records: list[Record] = field(default_factory=list)
    url: str = ""


def error_message(body: bytes) -> str:
    """An error body's message (OpenAI's, Anthropic's or FastAPI's shape), else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:ERROR_CHARS]
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])[:ERROR_CHARS]
        if "detail" in data:
            return str(data["detail"])[:ERROR_CHARS]
    return json.dumps(data)[:ERROR_CHARS]


def proxy_app(proxy: Proxy, session: aiohttp.ClientSession) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if "Content-Encoding" in request.headers:  # the body goes on as sent, still encoded
            headers["Content-Encoding"] = request.headers["Content-Encoding"]
        async with session.request(
            request.method, proxy.upstream + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as upstream:
            record = Record(request.method, request.path_qs, upstream.status)
            proxy.records.append(record)
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            if upstream.status >= 400 or request.method == "HEAD":
                payload = await upstream.read()
                if upstream.status >= 400:
                    record.error = error_message(payload)
                return web.Response(status=upstream.status, body=payload or None, headers=out_headers)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            tail = b""
            try:
                async for chunk in upstream.content.iter_any():
                    tail = (tail + chunk)[-4096:]
                    if STREAM_ERROR.search(tail):
                        record.stream_error = True
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:
                pass  # the CLI hung up (stopped at the run's bound, or it gave up on the stream)
            return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- servers -----------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def find_vllm_python(explicit: str | None) -> Path:
    candidate = explicit or os.environ.get("ONEHOP_VLLM_PYTHON")
    if not candidate:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_vllm.sh")], cwd=ROOT, capture_output=True, text=True, check=True
        )
        candidate = done.stdout.strip().splitlines()[-1]
    return Path(candidate)


def start_vllm(python: Path, folder: Path) -> Server:
    port = free_port()
    argv = ["bash", str(ROOT / "scripts" / "vllm_serve.sh"), str(ensure_tiny_model()), str(port)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL, *CLAUDE_NAMES]
    argv += ["--override-generation-config", json.dumps({"max_new_tokens": MAX_NEW_TOKENS})]
    argv += ["--logits-processors", "vllm_agent_script:AgentScript"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        ONEHOP_VLLM_PYTHON=str(python),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",  # above the tiny model's 4096 positions (rope extrapolates)
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONPATH=str(ROOT / "scripts"),  # vllm_agent_script
        ONEHOP_AGENT_SCRIPT_CALLS=json.dumps(AGENT_CALLS),
    )
    return spawn("vLLM", argv, port, folder, env)


def start_onehop(folder: Path) -> Server:
    port = free_port()
    options = {"mode": "agent", "agent_calls": AGENT_CALLS, "max_model_len": MAX_MODEL_LEN}
    argv = [
        sys.executable, "-m", "onehop", "serve", "--backend", "sim", "--model", str(ensure_tokenizer()),
        "--served-model-name", MODEL, "--alias", "claude-*", "--port", str(port),
        "--reasoning-parser", "qwen3", "--tool-parser", "hermes",
        *(f"--backend-option={key}={json.dumps(value)}" for key, value in options.items()),
    ]  # fmt: skip
    return spawn("onehop", argv, port, folder, dict(os.environ))


def spawn(name: str, argv: list[str], port: int, folder: Path, env: dict[str, str]) -> Server:
    path = folder / f"{name}.log"
    with path.open("wb") as sink:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(name, f"http://127.0.0.1:{port}", process, path)


async def wait_healthy(session: aiohttp.ClientSession, server: Server) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited {server.process.returncode}: {server.log.read_text()[-3000:]}")
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.name} did not come up in {START_S} s: {server.log.read_text()[-3000:]}")


def stop(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


# --- CLI runs ----------------------------------------------------------------------------


@dataclass
class Run:
    cli: str
    server: str
    records: list[Record]
    exit: int | None
    """None: ran past the bound and was stopped."""
    stdout: str
    seconds: float


def home(folder: Path) -> tuple[Path, Path]:
    """A fresh HOME, and a work folder inside a git repository (Codex's default requirement)."""
    user, work = folder / "home", folder / "work"
    user.mkdir(parents=True)
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    return user, work


def base_env(user: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(user), "LANG": "C.UTF-8", "TERM": "dumb"}


def codex_command(base_url: str, folder: Path) -> tuple[list[str], dict[str, str], Path]:
    user, work = home(folder)
    codex_home = user / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(base_url, MODEL))
    env = {**base_env(user), "CODEX_HOME": str(codex_home), "OPENAI_API_KEY": KEY}
    return [str(CODEX), "exec", PROMPT], env, work


def claude_command(base_url: str, folder: Path) -> tuple[list[str], dict[str, str], Path]:
    user, work = home(folder)
    env = {**base_env(user), **CLAUDE_QUIET, "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": KEY}
    return [str(CLAUDE), "-p", PROMPT], env, work


CLIS: dict[str, Callable[[str, Path], tuple[list[str], dict[str, str], Path]]] = {
    "Codex CLI": codex_command,
    "Claude Code": claude_command,
}


async def run_cli(cli: str, server: str, proxy: Proxy, folder: Path, bound_s: float) -> Run:
    argv, env, work = CLIS[cli](proxy.url, folder)
    proxy.records = []
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    exit_code: int | None
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), bound_s)
        exit_code = process.returncode
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = await process.communicate()
        exit_code = None
    seconds = time.monotonic() - started
    (folder / "stdout.txt").write_bytes(stdout)
    (folder / "stderr.txt").write_bytes(stderr)
    (folder / "requests.json").write_text(json.dumps([vars(record) for record in proxy.records], indent=1))
    return Run(cli, server, list(proxy.records), exit_code, stdout.decode(errors="replace"), seconds)


def answered(run: Run) -> bool:
    """A final answer on stdout (Claude Code prints its refusals there too, as `API Error: ...`)."""
    text = run.stdout.strip()
    return run.exit == 0 and bool(text) and not text.startswith("API Error")


# --- probes ------------------------------------------------------------------------------

LARK_PATCH = 'start: "*** Begin Patch" LF body "*** End Patch" LF?\nbody: /(.|\\n)*?/\nLF: "\\n"\n'

PROBES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    (
        "`ignore_eos` on /v1/responses",
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "Say hi.", "max_output_tokens": 16, "ignore_eos": True},
    ),
    (
        "`context_management` on /v1/messages",
        "POST",
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hi."}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
    ),
    ("`HEAD /`", "HEAD", "/", None),
    ("`POST /v1/responses/input_tokens`", "POST", "/v1/responses/input_tokens", {"model": MODEL, "input": "Say hi."}),
    (
        "`custom` tool with a Lark grammar on /v1/responses",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Patch the file.",
            "max_output_tokens": 64,
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "Apply a patch to the files.",
                    "format": {"type": "grammar", "syntax": "lark", "definition": LARK_PATCH},
                }
            ],
        },
    ),
    (
        "Codex's `namespace` tool on /v1/responses",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Say hi.",
            "max_output_tokens": 16,
            "tools": [
                {
                    "type": "namespace",
                    "name": "multi_agent_v1",
                    "description": "Sub-agents.",
                    "tools": [
                        {
                            "type": "function",
                            "name": "spawn_agent",
                            "description": "Start a sub-agent.",
                            "strict": False,
                            "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
                        }
                    ],
                }
            ],
        },
    ),
    (
        "Codex's `client_metadata` on /v1/responses",
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "Say hi.", "max_output_tokens": 16, "client_metadata": {"x-codex-installation-id": "x"}},
    ),
    (
        "`web_search` (hosted) tool on /v1/responses",
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "Say hi.", "max_output_tokens": 16, "tools": [{"type": "web_search"}]},
    ),
    (
        "Codex's namespaced call and its `function_call_output` without `call_id`",
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "max_output_tokens": 16,
            "input": [
                {"type": "message", "role": "user", "content": "Start an agent."},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "spawn_agent",
                    "namespace": "multi_agent_v1",
                    "arguments": '{"task": "x"}',
                },
                {"type": "function_call_output", "name": "spawn_agent", "namespace": "multi_agent_v1", "output": "started"},
            ],
        },
    ),
    (
        "Anthropic client tool `bash_20250124` on /v1/messages",
        "POST",
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hi."}],
            "tools": [{"type": "bash_20250124", "name": "bash"}],
        },
    ),
    (
        "`role: system` message inside `messages` on /v1/messages",
        "POST",
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hi."}, {"role": "system", "content": "Be brief."}],
        },
    ),
]
"""Sent after the CLI runs, so that a probe that upsets a server cannot change the runs' rows."""


async def probe(session: aiohttp.ClientSession, base_url: str, method: str, path: str, body: Any) -> str:
    try:
        async with session.request(
            method, base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=PROBE_S)
        ) as resp:
            payload = await resp.read()
            if resp.status < 400:
                return str(resp.status)
            message = error_message(payload)[:120]
            return f"{resp.status}: {message}" if message else str(resp.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"no answer ({type(exc).__name__})"


# --- report ------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def run_row(run: Run) -> str:
    first = run.records[0] if run.records else None
    # HEAD / is Claude Code's reachability probe; the first API request is what gets refused or not.
    api = [r for r in run.records if r.path.startswith("/v1/")]
    first_api = api[0] if api else None
    ok = sum(1 for r in run.records if r.status < 400 and not r.stream_error)
    failed = len(run.records) - ok
    first_text = f"`{first.method} {first.path}` {first.status}" if first else "none"
    api_text = f"`{first_api.method} {first_api.path}` {first_api.status}" if first_api else "none"
    error = next((r.error for r in run.records if r.error), "")
    exit_text = "timeout" if run.exit is None else str(run.exit)
    loop = "yes" if MARKER in run.stdout else "no"
    return (
        f"| {run.cli} | {run.server} | {first_text} | {api_text} | {cell(error) or '-'} | {ok} | {failed} "
        f"| {exit_text} ({run.seconds:.0f} s) | {'yes' if answered(run) else 'no'} | {loop} |"
    )


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.uname().machine}, {model}, {os.cpu_count()} CPUs"


def version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


@contextlib.contextmanager
def servers(folder: Path, vllm_python: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        started.append(start_vllm(vllm_python, folder))
        started.append(start_onehop(folder))
        yield started
    finally:
        for server in reversed(started):
            stop(server)


@contextlib.asynccontextmanager
async def proxies(session: aiohttp.ClientSession, started: list[Server]) -> AsyncIterator[dict[str, Proxy]]:
    runners: list[web.AppRunner] = []
    out: dict[str, Proxy] = {}
    try:
        for server in started:
            proxy = Proxy(server.url)
            runner = web.AppRunner(proxy_app(proxy, session), access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            proxy.url = f"http://127.0.0.1:{port}"
            runners.append(runner)
            out[server.name] = proxy
        yield out
    finally:
        for runner in runners:
            await runner.cleanup()


async def measure(args: argparse.Namespace, folder: Path) -> str:
    vllm_python = find_vllm_python(args.vllm_python)
    commit = version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    header = [
        f"commit `{commit}`, {machine()}",
        f"Codex CLI {version([str(CODEX), '--version'])}, Claude Code {version([str(CLAUDE), '--version'])}, "
        f"vLLM {version([str(vllm_python), '-c', 'import vllm; print(vllm.__version__)'])} (CPU)",
    ]
    started_at = time.monotonic()
    runs: list[Run] = []
    probes: dict[str, dict[str, str]] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=True) as session:
        with servers(folder, vllm_python) as started:
            for server in started:
                log(f"waiting for {server.name} ({server.log})")
                await wait_healthy(session, server)
            async with proxies(session, started) as by_name:
                for cli in CLIS:
                    for server in started:
                        log(f"running {cli} against {server.name} (at most {args.run_s:.0f} s)")
                        where = folder / f"{cli.split()[0].lower()}-{server.name.lower()}"
                        runs.append(await run_cli(cli, server.name, by_name[server.name], where, args.run_s))
            for server in started:
                for label, method, path, body in PROBES:
                    probes.setdefault(label, {})[server.name] = await probe(session, server.url, method, path, body)
    wall = time.monotonic() - started_at
    names = [server.name for server in started]
    lines = [*header, ""]
    lines += [
        "| CLI | server | first request | first API request | first error (200 chars) | 2xx | 4xx/5xx or error event "
        "| exit (time) | final answer | tool loop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [run_row(run) for run in runs]
    lines += ["", "| probe | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, by_server in probes.items():
        lines.append(f"| {label} | " + " | ".join(cell(by_server.get(name, "-")) for name in names) + " |")
    lines += ["", f"wall time {wall:.0f} s (servers' start included)"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-s", type=float, default=90.0, help="bound on one CLI run in seconds (90)")
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python (else $ONEHOP_VLLM_PYTHON, else setup_vllm.sh)")
    parser.add_argument("--keep", default=None, help="keep servers' logs and CLI outputs in this folder")
    args = parser.parse_args()
    if args.keep:
        folder = Path(args.keep)
        folder.mkdir(parents=True, exist_ok=True)
        print(asyncio.run(measure(args, folder)))
        return 0
    with tempfile.TemporaryDirectory(prefix="agent-compat-") as tmp:
        print(asyncio.run(measure(args, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
