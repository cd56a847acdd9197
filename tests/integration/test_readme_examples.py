"""README's "Set up" examples, as written, against `onehop serve` started by its command line
on the tiny model: each shows a non-empty answer (not `content: null`, not nothing)."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

# The examples run against `onehop serve` started by its command line (torch and the tiny
# model): kept out of the default suite, run by CI's `-m slow` stage.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000"
START_S = 180
ANSWER_S = 60
"""Bounds on the model load and on one answer (16 tokens of the tiny model: well under a second)."""


def _set_up() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text[text.index("## Set up\n") : text.index("\n## ", text.index("## Set up\n") + 1)]


def _block(language: str, containing: str) -> str:
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", _set_up(), re.S) if containing in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def _curl_body() -> dict[str, object]:
    words = shlex.split(_block("bash", "curl").replace("\\\n", " "))
    body = json.loads(words[words.index("-d") + 1])
    assert isinstance(body, dict)
    return body


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "onehop", "serve", "--port", str(port)], cwd=ROOT, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"onehop serve did not listen:\n{log.read_text()}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


async def test_the_curl_example_answers_with_content(serve: str) -> None:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_S)) as session,
        session.post(serve + "/v1/chat/completions", json=_curl_body()) as response,
    ):
        assert response.status == 200, await response.text()
        answer = await response.json()
    content = answer["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip(), answer


def test_the_python_example_prints_an_answer(serve: str) -> None:
    code = _block("python", "from openai import OpenAI")
    assert README_URL in code
    result = subprocess.run(
        [sys.executable, "-c", code.replace(README_URL, serve)], capture_output=True, text=True, timeout=ANSWER_S
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.strip()
    assert printed and printed != "None", result


def test_the_set_up_command_installs_what_the_python_example_imports() -> None:
    extras = re.findall(r"pip install -e '\.\[(\w+)\]'", _block("bash", "python3 -m venv"))
    assert extras == ["engine"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    installed = [*project["dependencies"], *project["optional-dependencies"]["engine"]]
    assert any(re.match(r"openai\b", requirement) for requirement in installed)
