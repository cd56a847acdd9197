"""API key files and the key check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.edge.auth import KeyFileError, check_key, load_key_file
from gateway.edge.errors import Unauthorized


def test_key_file_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nplain-key\n\n  batch   batch-key  \n")
    keys = load_key_file(path)
    plain, batch = check_key("Bearer plain-key", keys), check_key("Bearer batch-key", keys)
    assert plain.tenant is None and batch.tenant == "batch"
    assert check_key("bearer plain-key", keys) == plain and check_key("BEARER  batch-key ", keys) == batch  # the scheme is case-insensitive
    for header in (None, "plain-key", "Basic plain-key", "Bearer", "Bearer plain-ke", "Bearer batch"):
        with pytest.raises(Unauthorized):
            check_key(header, keys)


def test_each_key_without_a_tenant_owns_its_stored_responses(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("plain-one\nplain-two\nteam team-one\nteam team-two\n")
    keys = load_key_file(path)
    owners = [check_key(f"Bearer {key}", keys).owner for key in ("plain-one", "plain-two", "team-one", "team-two")]
    assert owners[0] != owners[1] and owners[2] == owners[3] == "tenant:team"
    assert not any("plain" in owner for owner in owners[:2])  # the key itself is kept nowhere


def test_bad_key_files_name_the_line_but_not_the_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("ok-key\nteam secret-one extra\n")
    with pytest.raises(KeyFileError, match=r"keys:2: want") as caught:
        load_key_file(path)
    assert "secret-one" not in str(caught.value)
    path.write_text("# only comments\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        load_key_file(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_key_file(tmp_path / "missing")


def test_x_api_key_is_a_key_too(tmp_path: Path) -> None:
    """Anthropic's clients send `x-api-key`; a Bearer key, when sent, is the one checked."""
    path = tmp_path / "keys"
    path.write_text("team team-key\n")
    keys = load_key_file(path)
    assert check_key(None, keys, "team-key").tenant == "team"
    assert check_key(None, keys, " team-key ") == check_key("Bearer team-key", keys)
    assert check_key("Bearer team-key", keys, "wrong").tenant == "team"
    for authorization, api_key in ((None, "wrong"), (None, ""), ("Bearer wrong", "team-key"), (None, None)):
        with pytest.raises(Unauthorized) as caught:
            check_key(authorization, keys, api_key)
    assert "`x-api-key: <key>`" in caught.value.message and "`Authorization: Bearer <key>`" in caught.value.message
