"""Offline tokenizer folders for other model families: Qwen3's BPE plus that family's markers.

No hub is reachable, so a DeepSeek, GLM, Kimi, MiniMax or Mistral tokenizer
cannot be downloaded. What a reasoning / tool parser depends on is not the
BPE but the family's marker tokens (``<｜tool▁calls▁begin｜>``,
``<|tool_calls_section_begin|>``, ``[TOOL_CALLS]``, ...) being single added
tokens, special or not as in the real tokenizer. So a family tokenizer here is
the offline Qwen3 tokenizer (``engine.qwen3.fixtures.ensure_tokenizer``) with
the given added tokens appended at the next free ids after Qwen3's 26,
``tokenizer_config.json`` (``added_tokens_decoder``, the EOS) and
``generation_config.json`` (the EOS id) to match, and optionally a chat template.
Both transformers' ``AutoTokenizer`` and vLLM's ``get_tokenizer`` load it offline.

What differs from the real model tokenizers, so nothing may rely on it:
- the BPE (merges, pre-tokeniser, normaliser) is Qwen's, so ordinary text
  splits into other pieces and other ids than the real model's;
- every id differs: markers get ids from 151,669 up in the order given, and
  a marker Qwen3 already has (``<think>``, ``<tool_call>``) keeps Qwen3's id;
- Qwen3's own added tokens (``<|im_start|>``, ``<|im_end|>``, ...) stay, and
  unless ``eos`` is given the EOS is Qwen3's (``<|im_end|>``, and
  ``<|endoftext|>`` in the generation config);
- without ``chat_template`` the folder keeps Qwen3's template.
Tests must therefore encode text with the fixture and look ids up by token,
never hard-code an id.

Each folder is built once per cache, under a name carrying a builder version
and a digest of what was asked for, in a temporary sibling renamed into place
(``engine.qwen3.fixtures``' build-once helper).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from engine.qwen3.fixtures import TOKENIZER_FILES, _ensure, ensure_tokenizer

FAMILY_TOKENIZER_VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DIGEST_CHARS = 12


def build_family_tokenizer(
    root: Path,
    name: str,
    added: Sequence[tuple[str, bool]],
    *,
    chat_template: str | None = None,
    eos: str | None = None,
) -> Path:
    """The tokenizer folder ``name`` under the cache ``root``: Qwen3 plus ``added`` (content, special).

    ``eos`` names the EOS token (one of ``added`` or a Qwen3 token); it becomes
    ``eos_token`` and the only ``eos_token_id`` of the generation config.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"family tokenizer name {name!r} is not a plain folder name")
    spec = {"added": [[content, bool(special)] for content, special in added], "template": chat_template, "eos": eos}
    digest = hashlib.sha256(json.dumps(spec, ensure_ascii=False).encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
    base = ensure_tokenizer(root)
    target = root / f"{name}-tokenizer-v{FAMILY_TOKENIZER_VERSION}-{digest}"
    return _ensure(target, TOKENIZER_FILES, lambda out: _write(out, base, added, chat_template, eos))


def token_id(folder: Path, content: str) -> int:
    """The id of ``content`` in a tokenizer folder (raises if it is not one token)."""
    found = _load(folder).token_to_id(content)
    if found is None:
        raise KeyError(f"{content!r} is not a token of {folder}")
    return int(found)


@functools.cache
def _load(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _write(
    out: Path, base: Path, added: Sequence[tuple[str, bool]], chat_template: str | None, eos: str | None
) -> None:
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    config = _read_json(base / "tokenizer_config.json")
    special_map = _read_json(base / "special_tokens_map.json")
    generation = _read_json(base / "generation_config.json")
    decoder: dict[str, dict[str, Any]] = config["added_tokens_decoder"]
    existing = {entry["content"] for entry in decoder.values()}
    extra_special: list[str] = config.get("additional_special_tokens") or []
    for content, special in added:
        if content in existing:
            continue
        if special:
            tokenizer.add_special_tokens([_added(content, special)])
        else:
            tokenizer.add_tokens([_added(content, special)])
        decoder[str(tokenizer.token_to_id(content))] = _entry(content, special)
        existing.add(content)
        if special:
            extra_special.append(content)
    config["additional_special_tokens"] = extra_special
    special_map["additional_special_tokens"] = extra_special
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None or eos not in existing:
            raise ValueError(f"eos {eos!r} is neither one of the added tokens nor a Qwen3 added token")
        config["eos_token"] = eos
        special_map["eos_token"] = _entry(eos, True)
        generation["eos_token_id"] = [eos_id]
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special_map)
    _write_json(out / "generation_config.json", generation)
    if chat_template is None:
        shutil.copyfile(base / "chat_template.jinja", out / "chat_template.jinja")
    else:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)


def _entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def _read_json(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
