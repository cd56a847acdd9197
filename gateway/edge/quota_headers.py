"""The rate-limit headers of a tenant with quotas, in the API's own words.

OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`):

    x-ratelimit-limit-requests / -tokens       requests_per_minute / the token limit
    x-ratelimit-remaining-requests / -tokens   what the bucket holds now
    x-ratelimit-reset-requests / -tokens       until it is full again, as OpenAI writes
                                               durations (`20ms`, `1s`, `6m0s`)

Anthropic (`/v1/messages`): `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`,
the reset as an RFC 3339 time. A 429 carries `Retry-After` (whole seconds) besides.

The token headers describe one token limit: the one that refused the request, else
`tokens_per_minute` when the tenant has it, else `tokens_per_day`.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from gateway.edge.quota import Decision, Level


def openai_duration(seconds: float) -> str:
    """`20ms`, `1s`, `1.5s`, `6m0s`, `2h0m0s`: Go's duration format, which OpenAI's headers use."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rfc3339(seconds: float, now: datetime | None = None) -> str:
    at = (now or datetime.now(UTC)) + timedelta(seconds=math.ceil(seconds))
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _token_level(decision: Decision) -> Level | None:
    refused = decision.refused_by
    if refused is not None and refused != "requests_per_minute":
        return decision.level(refused)
    return decision.level("tokens_per_minute") or decision.level("tokens_per_day")


def quota_headers(decision: Decision, *, anthropic: bool) -> dict[str, str]:
    """The headers for `decision`; with `Retry-After` when it refused."""
    headers: dict[str, str] = {}
    for kind, level in (("requests", decision.level("requests_per_minute")), ("tokens", _token_level(decision))):
        if level is None:
            continue
        limit, remaining = str(level.limit.capacity), str(level.remaining)
        if anthropic:
            headers[f"anthropic-ratelimit-{kind}-limit"] = limit
            headers[f"anthropic-ratelimit-{kind}-remaining"] = remaining
            headers[f"anthropic-ratelimit-{kind}-reset"] = rfc3339(level.reset_s)
        else:
            headers[f"x-ratelimit-limit-{kind}"] = limit
            headers[f"x-ratelimit-remaining-{kind}"] = remaining
            headers[f"x-ratelimit-reset-{kind}"] = openai_duration(level.reset_s)
    if not decision.admitted:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_s)))
    return headers
