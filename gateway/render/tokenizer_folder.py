"""A model folder's tokenizer and chat templates, read with `tokenizers` alone.

The gateway renders chat requests itself, and transformers (with torch behind
it) costs about 400 MB of RSS for what is, at render time, a `tokenizers`
object, a few special-token strings and a jinja template. This module reads
the folder the way transformers' `AutoTokenizer.from_pretrained` does for a
folder with a `tokenizer.json`:

- the backend is `tokenizer.json` as written, its post-processor included (so
  `add_special_tokens=True` adds a BOS exactly where transformers would);
- added tokens that `tokenizer_config.json` declares (`added_tokens_decoder`)
  and the backend lacks are added, then the named special tokens are
  (re)added as special, as transformers does after loading;
- the special tokens a template sees are the config's named ones
  (`bos_token`, ... as strings or AddedToken dicts) and any other `*_token`
  string, with the legacy `special_tokens_map.json` merged in only when the
  config has no `added_tokens_decoder` (transformers reads it only then);
- templates: `chat_template.jinja` and `additional_chat_templates/*.jinja`
  take priority over the config's `chat_template` (a string, or a list of
  `{name, template}`).

What it does not copy: transformers' per-class rebuilding of some backends
(a Llama-class tokenizer rebuilt from its vocabulary) and class defaults for
special tokens the config does not name. A folder without `tokenizer.json`
(only a slow tokenizer) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
LEGACY_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
DEFAULT_TEMPLATE = "default"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerFolderError(Exception):
    """The folder has no usable `tokenizer.json`, or a config file that is not what it claims."""


@dataclass(frozen=True)
class TokenizerFolder:
    tokenizer: Tokenizer
    special_tokens: dict[str, str]
    """The variables a chat template sees for the special tokens (`bos_token`, ...)."""
    templates: dict[str, str]
    """Chat templates by name; a folder with one template has it under `default`."""


def load_folder(folder: str | Path) -> TokenizerFolder:
    root = Path(folder)
    path = root / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerFolderError(f"{root} has no {TOKENIZER_FILE}: the gateway renders with the fast tokenizer only")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises bare Exceptions for malformed files
        raise TokenizerFolderError(f"{path} could not be loaded: {exc}") from exc
    config = _read_json(root / CONFIG_FILE)
    merged = _with_legacy_tokens(root, config)
    named = {key: merged[key] for key in NAMED_SPECIAL_TOKENS if merged.get(key) is not None}
    _add_tokens(tokenizer, config, named, _extra_tokens(merged))
    if config.get("split_special_tokens"):
        tokenizer.encode_special_tokens = True
    return TokenizerFolder(tokenizer, _template_variables(config, named), _templates(root, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFolderError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerFolderError(f"{path} is not a JSON object")
    return data


def _with_legacy_tokens(root: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The config with `special_tokens_map.json` over it, for configs from before `added_tokens_decoder`.

    Its `additional_special_tokens` are not read: transformers 5 renamed them
    `extra_special_tokens` before merging this file, and reads only the new name from it."""
    merged = {**config, "extra_special_tokens": _extra_tokens(config)}
    if "added_tokens_decoder" in config:
        return merged
    for key, value in _read_json(root / LEGACY_SPECIAL_TOKENS_FILE).items():
        if key == "extra_special_tokens" and isinstance(value, list):
            merged[key] = merged[key] + [token for token in value if token not in merged[key]]
        elif key in NAMED_SPECIAL_TOKENS:
            merged[key] = value
    return merged


def _content(token: Any) -> str:
    return str(token["content"]) if isinstance(token, dict) else str(token)


def _template_variables(config: dict[str, Any], named: dict[str, Any]) -> dict[str, str]:
    variables = {key: _content(value) for key, value in named.items()}
    # Model-specific tokens (`image_token`, ...) are special tokens to transformers too.
    for key, value in config.items():
        if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and isinstance(value, str):
            variables[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        variables.update({key: _content(value) for key, value in extra.items()})
    return variables


def _added_token(entry: Any, *, special: bool | None = None) -> AddedToken:
    """An AddedToken from a config entry; a plain string is normalized unless special (tokenizers' default)."""
    fields: dict[str, Any] = (
        {key: entry[key] for key in _ADDED_TOKEN_FIELDS if key in entry}
        if isinstance(entry, dict)
        else {"content": str(entry)}
    )
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _extra_tokens(config: dict[str, Any]) -> list[Any]:
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    return list(extra.values()) if isinstance(extra, dict) else list(extra)


def _add_tokens(tokenizer: Tokenizer, config: dict[str, Any], named: dict[str, Any], extra: list[Any]) -> None:
    """Add what the config declares and `tokenizer.json` lacks, then mark the special ones special."""
    declared = config.get("added_tokens_decoder") or {}
    have = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    missing = [_added_token(declared[key]) for key in sorted(declared, key=int) if _content(declared[key]) not in have]
    have |= {token.content for token in missing}
    specials = [*named.values(), *extra]
    missing += [_added_token(token, special=True) for token in specials if _content(token) not in have]
    if missing:
        tokenizer.add_tokens(missing)
    # Special tokens given as plain strings are re-added unnormalized, as transformers does after load.
    resolved = [
        token if isinstance(token, dict) else {"content": str(token), "normalized": False} for token in specials
    ]
    if resolved:
        tokenizer.add_special_tokens([_added_token(token, special=True) for token in resolved])


def _templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
    """Template files win over the config's templates (all of them, as in transformers)."""
    found: dict[str, str] = {}
    if (root / TEMPLATE_FILE).is_file():
        found[DEFAULT_TEMPLATE] = (root / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (root / TEMPLATE_DIR).is_dir():
        for path in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found
    declared = config.get("chat_template")
    if isinstance(declared, str):
        return {DEFAULT_TEMPLATE: declared}
    if isinstance(declared, list):
        if not all(isinstance(entry, dict) and "name" in entry and "template" in entry for entry in declared):
            raise TokenizerFolderError(f"{root / CONFIG_FILE}: each listed chat_template needs a name and a template")
        return {str(entry["name"]): str(entry["template"]) for entry in declared}
    return {}
