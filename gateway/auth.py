"""API keys: `Authorization: Bearer <key>` on the OpenAI routes (and optionally /metrics).

Keys come from a file (one per line, `KEY` or `TENANT KEY`; blank lines and
`#` comments skipped; hot-reloaded like the policy) and/or an environment
variable (comma separated, read at start). A key's tenant is what policy
rules match with `tenant:`. A presented key is hashed and compared with every
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


Keys = dict[bytes, str | None]
"""Key digest → its tenant (None: no tenant)."""


def load_key_file(path: Path) -> Keys:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    keys: Keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise KeyFileError(f"{path}:{number}: want `KEY` or `TENANT KEY`")  # the line itself is not echoed
        keys[_digest(fields[-1])] = fields[0] if len(fields) == 2 else None
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no key")
    return keys


def keys_from_env(name: str) -> Keys:
    value = os.environ.get(name, "")
    return {_digest(k.strip()): None for k in value.split(",") if k.strip()}


def check_key(header: str | None, known: Keys) -> str | None:
    """The key's tenant; Unauthorized unless the header carries one of the known keys."""
    scheme, _, credentials = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():  # the scheme is case-insensitive (RFC 9110)
        raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
    given = _digest(credentials.strip())
    matched = False
    tenant = None
    for key, owner in known.items():  # every key is compared: no early exit
        if hmac.compare_digest(given, key):
            matched, tenant = True, owner
    if not matched:
        raise Unauthorized("invalid API key")
    return tenant


PROTECTED_PREFIX = "/v1/"
TENANT_KEY = web.RequestKey("onehop_tenant", str)


def needs_key(request: web.Request, protect_metrics: bool) -> bool:
    path = request.path
    return path.startswith(PROTECTED_PREFIX) or (protect_metrics and path == "/metrics")
