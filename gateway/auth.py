"""API keys: `Authorization: Bearer <key>` on the OpenAI routes (and optionally /metrics).

Keys come from a file (one per line; blank lines and `#` comments skipped;
hot-reloaded like the policy) and/or an environment variable (comma
separated, read at start). A presented key is hashed and compared with every
known key's hash by `hmac.compare_digest`, so the time taken says nothing
about how much of a key matched or which one. Keys never reach logs or spans.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from aiohttp import web

from gateway.errors import Unauthorized


class KeyFileError(ValueError):
    pass


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_key_file(path: Path) -> frozenset[bytes]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no key")
    return frozenset(_digest(k) for k in keys)


def keys_from_env(name: str) -> frozenset[bytes]:
    value = os.environ.get(name, "")
    return frozenset(_digest(k.strip()) for k in value.split(",") if k.strip())


def check_key(header: str | None, known: frozenset[bytes]) -> None:
    """Raise Unauthorized unless the header carries one of the known keys."""
    if not header or not header.startswith("Bearer "):
        raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
    given = _digest(header[len("Bearer "):].strip())
    matched = False
    for key in known:  # every key is compared: no early exit
        matched |= hmac.compare_digest(given, key)
    if not matched:
        raise Unauthorized("invalid API key")


PROTECTED_PREFIX = "/v1/"


def needs_key(request: web.Request, protect_metrics: bool) -> bool:
    path = request.path
    return path.startswith(PROTECTED_PREFIX) or (protect_metrics and path == "/metrics")
