"""The access log never carries a query string: clients put keys there."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from engine.config import EngineConfig
from onehop.serve import embedded


async def test_a_key_in_the_query_string_stays_out_of_the_access_log(
    qwen3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim")
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="derender") as running,
        aiohttp.ClientSession() as session,
        session.get(running.url + "/v1/models?api_key=sk-secret-walrus-42") as response,
    ):
        assert response.status == 200
    lines = [record.getMessage() for record in caplog.records if record.name == "aiohttp.access"]
    assert any('"GET /v1/models" 200' in line for line in lines), lines
    assert "sk-secret-walrus-42" not in caplog.text
