"""A request's priority: its tenant's, or the one it asks for, capped by its tenant's allowance.

vLLM's convention throughout: lower is served sooner, 0 the default. A request asks with the
`X-Vllm-Priority` header (vLLM's own, read first, as vLLM reads it) or a non-zero `priority`
in the body (chat and completions; vLLM's field, whose default 0 cannot be told from "not
sent", so 0 in the body asks for nothing); a header that is no 64-bit integer is ignored, as
vLLM ignores it. What it asks is capped at its tenant's
`best_priority` (by default the tenant's `priority`: a request may make itself less urgent,
never more); the cap is silent, as vLLM clips nothing and a client cannot know its allowance.
The result orders the admission queue and goes to the engines as the generate request's
`priority`.
"""

from __future__ import annotations

from collections.abc import Mapping

from wire.openai_schema import INT64_MAX, INT64_MIN
from gateway.config import Tenant

PRIORITY_HEADER = "X-Vllm-Priority"


def asked(headers: Mapping[str, str], body_priority: int) -> int | None:
    """The priority the request asks for; None: none."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is not None and len(raw) <= 20:  # longer is no 64-bit number
        try:
            value = int(raw)
        except ValueError:
            pass  # vLLM ignores a header that is not a number, and so do we
        else:
            if INT64_MIN <= value <= INT64_MAX:
                return value
    return body_priority or None


def effective(tenant: Tenant, request: int | None) -> int:
    """The priority the request is served at."""
    if request is None:
        return tenant.priority
    best = tenant.priority if tenant.best_priority is None else tenant.best_priority
    return max(request, best)
