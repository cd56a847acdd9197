"""A real Arize Phoenix (an OTLP receiver with an LLM trace UI) of the test's own: `phoenix serve`
from its venv (scripts/setup_phoenix.sh makes it), on free loopback ports, its SQLite database in
a temporary folder; the spans it stored read back through its REST API.

Without the venv the tests that need it skip, saying so, unless `ONEHOP_REQUIRE_PHOENIX` is set
(by .ci/run, which makes it): then they fail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.ports import free_port, until_answering
from tests.support.waiting import POLL_S

REQUIRED_ENV = "ONEHOP_REQUIRE_PHOENIX"
"""Set (by .ci/run): a missing Phoenix venv fails the tests that need it instead of skipping them."""
VENV_ENV = "ONEHOP_PHOENIX_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "onehop" / "phoenix-venv"
START_S = 90.0
"""Its first start creates and migrates the database: ~10 s here, more on a busy machine."""
PROJECT = "default"
"""Where Phoenix files spans whose resource names no project (onehop's do not)."""


class PhoenixError(AssertionError):
    """Phoenix did not come up, or its API answered with an error."""


def phoenix_binary() -> Path:
    """`phoenix` in its venv; skips (or fails, under `ONEHOP_REQUIRE_PHOENIX`) without one."""
    found = Path(os.environ.get(VENV_ENV, DEFAULT_VENV)) / "bin" / "phoenix"
    if not found.is_file():
        missing = f"no Phoenix venv at {found.parent.parent} (bash scripts/setup_phoenix.sh makes it; .ci/run does)"
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(f"{REQUIRED_ENV} is set but {missing}", pytrace=False)
        pytest.skip(missing)
    return found


@dataclass(frozen=True)
class StoredSpan:
    """A span as Phoenix stored it: its own idea of the kind (`LLM`, `CHAIN`, `UNKNOWN`, ...)
    and attributes (OpenTelemetry GenAI ones mapped to OpenInference's `llm.*`)."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str | None
    attributes: dict[str, Any]
    start: str

    @classmethod
    def of(cls, raw: dict[str, Any]) -> StoredSpan:
        context = raw["context"]
        return cls(
            raw["name"], raw["span_kind"], context["trace_id"], context["span_id"], raw.get("parent_id"),
            raw.get("attributes") or {}, raw["start_time"],
        )  # fmt: skip


class Phoenix:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self._session = url, session
        self.otlp_http = url + "/v1/traces"
        """Where an OTLP/HTTP exporter sends spans (`tracing.endpoint`)."""

    async def spans(self, project: str = PROJECT) -> list[StoredSpan]:
        """Every span of `project`, oldest first."""
        spans: list[StoredSpan] = []
        params: dict[str, Any] = {"limit": 1000, "sort": "start_time", "order": "asc"}
        while True:
            async with self._session.get(f"{self.url}/v1/projects/{project}/spans", params=params) as resp:
                if resp.status != 200:
                    raise PhoenixError(f"GET spans: {resp.status} {await resp.text()}")
                page = await resp.json()
            spans += [StoredSpan.of(raw) for raw in page["data"]]
            if not page.get("next_cursor"):
                return spans
            params["cursor"] = page["next_cursor"]

    async def project_id(self, project: str = PROJECT) -> str:
        """The project's id, as its pages' URLs name it."""
        async with self._session.get(f"{self.url}/v1/projects/{project}") as resp:
            if resp.status != 200:
                raise PhoenixError(f"GET project: {resp.status} {await resp.text()}")
            return str((await resp.json())["data"]["id"])


def phoenix_env(folder: Path, port: int, grpc_port: int) -> dict[str, str]:
    """`phoenix serve`'s settings: loopback ports, SQLite in `folder`, nothing sent anywhere else."""
    return {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(folder),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
    }


@asynccontextmanager
async def phoenix_server(folder: Path) -> AsyncIterator[Phoenix]:
    """`phoenix serve` with its data and log in `folder`, stopped at the end."""
    binary = phoenix_binary()
    port = free_port()
    env = phoenix_env(folder, port, free_port())
    with (folder / "phoenix.log").open("ab") as log:
        process = subprocess.Popen([str(binary), "serve"], stdout=log, stderr=subprocess.STDOUT, cwd=folder, env=env)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}"
            await until_answering(
                session, url + "/healthz", process, folder / "phoenix.log", within_s=START_S, every_s=POLL_S * 20, error=PhoenixError
            )
            yield Phoenix(url, session)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait)

