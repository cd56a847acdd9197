"""Per-tenant prefix-cache isolation: the `cache_salt` the gateway sets from the tenant.

vLLM keys a prompt's first KV block with the request's `cache_salt`, so prompts with
different salts never share cached blocks, and prefix-cache timing (a faster first token for
a prefix someone else sent) cannot tell one tenant what another sends. The salt is set by the
gateway, not the client: a keyed hash of the tenant's name, replacing any salt the client sent,
unless the tenant is configured to share cache (`tenants.NAME.share_cache`). Requests without
a tenant (auth off, or a key that names none) keep the client's salt, as vLLM does.
"""

from __future__ import annotations

import hashlib
import os

from gateway.config import GatewayConfig

FIXED_KEY = b"onehop cache salt v1"
"""The key when no secret is configured: salts are then computable by anyone who knows a
tenant's name, which matters only to clients that can reach engines directly."""


class CacheSalts:
    def __init__(self, config: GatewayConfig) -> None:
        secret = os.environ.get(config.cache_salt_secret_env)
        self._key = hashlib.blake2b(secret.encode(), digest_size=32).digest() if secret else FIXED_KEY
        self._config = config

    def salt(self, tenant: str | None, client_salt: str | None) -> str | None:
        """The `cache_salt` the engine gets for this request."""
        if tenant is None or self._config.tenant(tenant).share_cache:
            return client_salt
        digest = hashlib.blake2b(tenant.encode(), key=self._key, digest_size=16).hexdigest()
        return f"tenant-{digest}"
