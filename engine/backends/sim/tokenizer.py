"""The tokenizer folder: loading it, its full vocabulary size, its EOS ids, encoding text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from engine.backends.sim.config import SimConfigError


def encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    """Text to ids, without the special tokens a template would add."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
        raise SimConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc


def vocab_size(tokenizer: Tokenizer) -> int:
    """The full size, added tokens included: one past the highest id."""
    added = tokenizer.get_added_tokens_decoder()
    return max(tokenizer.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)


def eos_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS ids in preference order: generation_config.json, else the tokenizer's EOS."""
    generation = _read_json(folder / "generation_config.json")
    configured = generation.get("eos_token_id")
    if isinstance(configured, int):
        return (configured,)
    if isinstance(configured, list) and all(isinstance(i, int) for i in configured):
        return tuple(configured)
    token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return () if token_id is None else (token_id,)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise SimConfigError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a special token; -1 when the tokenizer lacks it (no checked prompt holds -1)."""
    token_id = tokenizer.token_to_id(token)
    return -1 if token_id is None else token_id
