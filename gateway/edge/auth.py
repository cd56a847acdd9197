"""API keys: `Authorization: Bearer <key>` or `x-api-key: <key>` on every `/v1/` route (and
optionally /metrics). OpenAI's clients send the first, Anthropic's (Claude Code with its usual
`ANTHROPIC_API_KEY`) the second; either works on every route.

Keys come from a file (one per line, `KEY` or `TENANT KEY`; blank lines and
`#` comments skipped; hot-reloaded like the policy) and/or an environment
variable (comma separated, read at start). A key's tenant is what policy
rules match with `tenant:`, and whose stored Responses a request may see
(its `owner`: the tenant, or the key itself when it names none). A presented
key is hashed and compared with every known key's hash by
`hmac.compare_digest`, so the time taken says nothing about how much of a key
matched or which one. Keys never reach logs or spans.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.edge.errors import Unauthorized


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


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None
    owner: str
    """Whose stored responses the request may read, continue and delete: its tenant's, or
    (a key that names no tenant) the key's own. Prefixed, so no tenant name can pose as a key."""


ANONYMOUS = "anonymous"
"""The one owner of every stored response when auth is off."""


def _owner(digest: bytes, tenant: str | None) -> str:
    if tenant is not None:
        return f"tenant:{tenant}"
    # Another hash of the key's digest, so the stored owner is not the digest keys are checked by.
    return "key:" + hashlib.sha256(b"onehop response owner\0" + digest).hexdigest()[:32]


def check_key(authorization: str | None, known: Keys, api_key: str | None = None) -> Caller:
    """Who is calling; Unauthorized unless `Authorization: Bearer` or, without one, `x-api-key`
    carries one of the known keys."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():  # the scheme is case-insensitive (RFC 9110)
        presented = credentials.strip()
    elif api_key is not None and api_key.strip():
        presented = api_key.strip()
    else:
        raise Unauthorized("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
    given = _digest(presented)
    matched = False
    tenant = None
    for key, owner in known.items():  # every key is compared: no early exit
        if hmac.compare_digest(given, key):
            matched, tenant = True, owner
    if not matched:
        raise Unauthorized("invalid API key")
    return Caller(tenant, _owner(given, tenant))


PROTECTED_PREFIX = "/v1/"
TENANT_KEY = web.RequestKey("onehop_tenant", str)
OWNER_KEY = web.RequestKey("onehop_owner", str)


def owner(request: web.Request) -> str:
    """The request's owner of stored responses (`Caller.owner`; `ANONYMOUS` with auth off)."""
    found: str = request.get(OWNER_KEY, ANONYMOUS)  # aiohttp types get() as Any, whatever the key
    return found


def needs_key(request: web.Request, protect_metrics: bool) -> bool:
    path = request.path
    return path.startswith(PROTECTED_PREFIX) or (protect_metrics and path == "/metrics")
