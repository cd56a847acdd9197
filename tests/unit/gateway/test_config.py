"""The example gateway config decodes, and a typo is an error that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]


def test_example_config_decodes() -> None:
    config = load_config(ROOT / "configs" / "gateway.yaml")
    assert config.route == "derender" and len(config.engines) == 2
    assert config.timeouts.first_token_s == 120


def test_unknown_key_is_named(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "gateway.yaml").read_text().replace("idle_s: 60", "idel_s: 60")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="idel_s"):
        load_config(path)


def test_remote_route_needs_a_url(tmp_path: Path) -> None:
    path = tmp_path / "remote.yaml"
    path.write_text("model: m\ntokenizer: t\nengines: [{url: 'http://x'}]\nroute: tokens-remote\n")
    with pytest.raises(ConfigError, match="remote_url"):
        load_config(path)
