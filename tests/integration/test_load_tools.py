"""guidellm and aiperf, the load generators pointed at vLLM servers, against `onehop serve` on
the simulator: guidellm's responses mode and aiperf's responses and messages modes, each
sending vLLM's `ignore_eos` (answers run to their token budget, as benchmarks want), end with
0 failed requests by each tool's own JSON report, and every answer reaches its budget.

The tools live in a venv of their own (scripts/setup_loadtools.sh; their pins clash with
onehop's), run as subprocesses, offline: the synthetic prompts are tokenized with the Qwen3
test tokenizer the server uses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a server and three tool runs of 12-16 s each: CI's second stage

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("ONEHOP_LOADTOOLS_VENV", Path.home() / ".cache" / "onehop" / "loadtools-venv"))
START_S = 120
"""Bound on `onehop serve` listening (the simulator loads only a tokenizer: a few seconds)."""
RUN_S = 120
"""Bound on one tool run (measured 12-16 s, most of it the tool's own start)."""
REQUESTS = 10
CONCURRENCY = 2
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 256
"""Twice the simulator's longest answer of its own (126 tokens in 60 tries): each request ends
at this budget only when `ignore_eos` is honoured, not when it is dropped as an unknown field."""
HUB_REPO = "onehop/qwen3-tokenizer"
"""The test tokenizer under a hub repo id: aiperf 0.13, offline, resolves a tokenizer only
through the hub cache (a folder path fails its repo-id check), so the folder is laid out there."""


@pytest.fixture(scope="module")
def tools() -> Path:
    """The load tools' bin folder; skipped, naming the setup script, when they are not installed."""
    missing = [name for name in ("guidellm", "aiperf") if not (VENV / "bin" / name).is_file()]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed in {VENV}: run scripts/setup_loadtools.sh (.ci/run does)")
    return VENV / "bin"


@pytest.fixture(scope="module")
def hub_cache(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding the test tokenizer as `HUB_REPO`'s one snapshot."""
    hub = tmp_path_factory.mktemp("hub")
    repo = hub / ("models--" + HUB_REPO.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in qwen3_tokenizer_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return hub


@pytest.fixture(scope="module")
def tool_env(hub_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tools' environment: offline, with their caches and settings in a folder of the test's."""
    home = tmp_path_factory.mktemp("tools-home")
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        "HF_HUB_CACHE": str(hub_cache),
        "XDG_CACHE_HOME": str(home / "cache"),
        "MPLCONFIGDIR": str(home / "matplotlib"),
    }


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`onehop serve --backend sim` as a user types it, on a free port; its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "onehop", "serve", "--backend", "sim", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out)
    try:
        _wait_listening(process, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"onehop serve did not listen:\n{log.read_text()}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_S, check=False)


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout + done.stderr)[-4000:]


def _ignored_fields(serve: str) -> list[str]:
    """The gateway's count of top-level fields it ignored as unknown: a tool's field must be
    served, not dropped (answers would still be 200s)."""
    with urllib.request.urlopen(serve + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return [line for line in text.splitlines() if line.startswith("onehop_gateway_ignored_fields_total{")]


def test_guidellm_responses_mode_with_ignore_eos(
    tools: Path, tool_env: dict[str, str], serve: str, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    report = tmp_path / "guidellm.json"
    backend = f"kind=openai_http,target={serve},model={qwen3_tokenizer_dir.name},request_format=/v1/responses"
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
    command = [
        str(tools / "guidellm"), "run", "--backend", backend,
        "--profile", f"kind=concurrent,streams={CONCURRENCY}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", data, "--tokenizer", f"kind=huggingface_auto,model={qwen3_tokenizer_dir}",
        "--output", f"kind=json,path={report}", "--disable-console",
    ]  # fmt: skip
    done = _run(command, tool_env, tmp_path)
    assert done.returncode == 0, _tail(done)  # guidellm exits 0 even when every request failed

    benchmark = json.loads(report.read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    failed = benchmark["requests"]["errored"] + benchmark["requests"]["incomplete"]
    why = [request["info"]["error"] for request in failed[:1]]  # guidellm keeps the status, not the answer
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, (totals, why)
    # guidellm asks for an exact output length with `ignore_eos` (and max_output_tokens) itself.
    bodies = [json.loads(request["request_args"])["body"] for request in benchmark["requests"]["successful"]]
    assert bodies and all(b["ignore_eos"] is True and b["max_output_tokens"] == OUTPUT_TOKENS for b in bodies), bodies
    lengths = {request["output_tokens"] for request in benchmark["requests"]["successful"]}
    assert lengths == {OUTPUT_TOKENS}, lengths
    assert _ignored_fields(serve) == []


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_aiperf_with_ignore_eos(
    endpoint: str, tools: Path, tool_env: dict[str, str], serve: str, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    command = [
        str(tools / "aiperf"), "profile", "--model", qwen3_tokenizer_dir.name, "--url", serve,
        "--endpoint-type", endpoint, "--streaming", "--tokenizer", HUB_REPO,
        "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
        "--isl", str(PROMPT_TOKENS), "--osl", str(OUTPUT_TOKENS), "--extra-inputs", "ignore_eos:true",
        "--random-seed", "0", "--artifact-dir", str(artifacts), "--ui", "none", "--no-auto-plot",
        # One worker and one record processor (aiperf otherwise sizes both by the CPU count), no
        # scrape of the server's /metrics, no GPU telemetry: 7 processes, 1.5 GB, not 9 and 1.8 GB.
        "--workers-max", "1", "--record-processors", "1", "--no-server-metrics", "--no-gpu-telemetry",
    ]  # fmt: skip
    done = _run(command, tool_env, tmp_path)
    records = artifacts / "profile_export.jsonl"
    lines = records.read_text().splitlines() if records.exists() else []
    errors = [record["error"] for record in map(json.loads, lines) if record.get("error")]
    # aiperf exits 1 when every request failed; each record carries the server's answer.
    assert done.returncode == 0 and not errors, (errors[:1], _tail(done))

    report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    counted_errors = (report.get("error_request_count") or {}).get("avg", 0)
    assert (report["request_count"]["avg"], counted_errors, report["error_summary"]) == (REQUESTS, 0, []), report
    sent = json.loads((artifacts / "inputs.json").read_text())
    payloads = [p for session in sent["data"] for p in session["payloads"]]
    assert len(payloads) == REQUESTS and all(p["ignore_eos"] is True for p in payloads), payloads[:1]
    lengths = report["output_sequence_length"]
    # aiperf counts by tokenizing the text it received, a few tokens off the engine's count (253
    # of 256): its --use-server-token-count reads usage only from `response.completed`, and an
    # answer cut at max_output_tokens ends with `response.incomplete`, as OpenAI's do.
    assert lengths["count"] == REQUESTS and lengths["min"] >= 0.9 * OUTPUT_TOKENS, lengths
    assert _ignored_fields(serve) == []
