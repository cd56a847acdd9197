"""README's set-up command, run verbatim from scratch, then README's Python example against
the server it started: a fresh copy of the repository (its tracked files), a fresh venv, the
install, `onehop serve` on 127.0.0.1:8000, and an answer printed by the example as written.

`test_readme_examples.py` runs the same examples against the package under test; this one
checks that what a new user types installs and serves (the `engine` extra brings the OpenAI
SDK the example imports)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_readme_examples import ANSWER_S, README_URL, _block

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000
"""Where README's command serves (`onehop serve`'s default)."""
READY_S = 1800
"""The whole set-up: a venv, the install (torch and transformers, from the index or a local
wheel cache), the tiny model's first load."""
UNINHERITED = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
"""The test run's own environment that would make the fresh venv less fresh."""


def _set_up_command() -> str:
    command = _block("bash", "python3 -m venv").strip()
    assert "\n" not in command, command
    return command


def _copy_tracked_files(destination: Path) -> None:
    """The repository as a clone has it: tracked files only, no venv, caches or builds."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail("this test copies the repository's tracked files: it needs git and a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        source = ROOT / name
        if not name or not source.is_file():  # a tracked file deleted in this checkout
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_listening(process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"README's set-up command exited {process.returncode}:\n{log.read_text(errors='replace')[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"README's set-up command did not serve within {READY_S} s:\n{log.read_text(errors='replace')[-6000:]}")
        try:
            with socket.create_connection(("127.0.0.1", PORT), timeout=1):
                return
        except OSError:
            time.sleep(1)


@pytest.fixture(scope="module")
def fresh_checkout(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Path]:
    """README's set-up command running in a fresh copy; yields the copy once it serves.

    `tiny_model_dir` builds the tiny model into the shared cache first, as `onehop serve`
    would on its first run, so the wait below is the install and one model load."""
    if not _port_is_free(PORT):
        pytest.fail(f"README's command serves on 127.0.0.1:{PORT}, which something else holds: stop it first")
    copy = tmp_path_factory.mktemp("checkout")
    _copy_tracked_files(copy)
    log = copy.parent / "set-up.log"
    env = {key: value for key, value in os.environ.items() if key not in UNINHERITED}
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", _set_up_command()], cwd=copy, env=env, stdout=out, stderr=out, start_new_session=True
        )
    try:
        _wait_listening(process, log)
        yield copy
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.mark.slow  # a fresh venv and a whole install: CI's second stage
def test_the_set_up_command_serves_and_the_python_example_prints_an_answer(fresh_checkout: Path) -> None:
    code = _block("python", "from openai import OpenAI")
    assert README_URL in code, code
    # The example's own first line says where it runs: the venv the set-up command made.
    python = fresh_checkout / ".venv" / "bin" / "python"
    result = subprocess.run(
        [str(python), "-c", code], cwd=fresh_checkout, capture_output=True, text=True, timeout=ANSWER_S
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.strip()
    assert printed and printed != "None", result
