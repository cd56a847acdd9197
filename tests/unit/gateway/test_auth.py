"""API key files and the key check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import KeyFileError, check_key, load_key_file
from gateway.errors import Unauthorized


def test_key_file_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nplain-key\n\n  batch   batch-key  \n")
    keys = load_key_file(path)
    assert check_key("Bearer plain-key", keys) is None
    assert check_key("Bearer batch-key", keys) == "batch"
    assert check_key("bearer plain-key", keys) is None and check_key("BEARER  batch-key ", keys) == "batch"  # the scheme is case-insensitive
    for header in (None, "plain-key", "Basic plain-key", "Bearer", "Bearer plain-ke", "Bearer batch"):
        with pytest.raises(Unauthorized):
            check_key(header, keys)


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
