"""The quota step of a request: reserve after render, settle from its outcome.

`QuotaCheck.reserve` runs in the pipeline once the prompts are rendered (so their exact token
counts are known) and before any engine request: it reserves the request's tokens from its
tenant's buckets (`gateway.edge.quota`) or raises `QuotaExceeded`, a 429 whose headers say
when to come back. `QuotaCheck.on_outcome` subscribes to the request's one outcome event and
settles in the background with what the request used:

    the answer's usage known        prompt + completion tokens
    a client that left              what its engines used until they stopped, as their
                                    abort answers say (waited for, bounded), or the
                                    tokens it was sent if more
    an error answer, no usage       the prompt tokens (it may have been prefilled)
    no usage otherwise (an engine   the reservation stands, as if all of it was used
    that failed mid-stream, a cut
    whose engine did not say)

A store that does not answer (Redis down or slow) is `state.quota_on_failure`'s choice: the
request admitted unchecked (`open`, the default) or a 503 `state_unavailable` (`closed`);
either is counted. A settle that fails is tried again a few times, then given up (counted):
its reservation stays charged (a settle never counts twice: the store forgets a reservation
once it is settled).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.edge.errors import QuotaExceeded, StateUnavailable
from gateway.edge.quota import Decision, Limit, QuotaStore, limits_of
from gateway.edge.quota_headers import openai_duration, quota_headers
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.outcome import Outcome, Tokens

log = logging.getLogger(__name__)
UNBOUNDED = 1 << 60
"""A completion budget nobody knows the bound of (no max_tokens, no known context): the
reservation takes each bucket's capacity."""
SETTLE_DELAYS_S = (0.1, 0.5, 2.0)
"""Waits before a failed settle is tried again (the store is down); then it is given up."""
CUT_USAGE_WAIT_S = 6.0
"""How long a cut request's settle waits for its engines' abort answers (each bounded by
`engine_client.ABORT_TIMEOUT_S`); past it the reservation stands."""


def request_tokens(prompts: Sequence[Sequence[int]], n: int, max_tokens: int | None, context: int | None) -> int:
    """What a request may cost: its prompt tokens and, for each prompt, `n` completions of
    max_tokens (capped by what the context leaves, as engines cap it) or of what the context
    leaves when max_tokens is not given."""
    total = 0
    for prompt in prompts:
        left = None if context is None else max(0, context - len(prompt))
        budget = max_tokens if left is None else (left if max_tokens is None else min(max_tokens, left))
        total += len(prompt) + n * (UNBOUNDED if budget is None else budget)
    return total


@dataclass(frozen=True, slots=True)
class _Held:
    tenant: str
    limits: tuple[Limit, ...]
    reserved: int
    """Tokens held in the buckets for it (the in-flight gauge's share)."""
    prompt: int


class QuotaCheck:
    def __init__(self, config: GatewayConfig, store: QuotaStore, metrics: GatewayMetrics, share: int = 1) -> None:
        self.config, self.store, self.metrics = config, store, metrics
        self._share = share
        self._limits: dict[str, tuple[Limit, ...]] = {}
        self._held: dict[str, _Held] = {}
        self._settling: set[asyncio.Task[None]] = set()

    @property
    def settling(self) -> int:
        """Settles not yet done (in flight, or waiting to be tried again)."""
        return len(self._settling)

    def limits(self, tenant: str | None) -> tuple[Limit, ...]:
        """The tenant's limits (its own entry's, else `"*"`'s); none without a tenant."""
        if tenant is None:
            return ()
        found = self._limits.get(tenant)
        if found is None:
            found = self._limits[tenant] = limits_of(self.config.tenant(tenant), self._share)
        return found

    async def reserve(
        self, tenant: str | None, reservation: str, tokens: int, *, prompt: int = 0, anthropic: bool = False
    ) -> Decision | None:
        """Reserve `tokens` (`prompt` of them the prompt's) and one request for `reservation`;
        the decision, for the answer's headers, or None when the tenant has no quota (or the
        store is down and quotas fail open)."""
        limits = self.limits(tenant)
        if not limits:
            return None
        assert tenant is not None
        try:
            decision = await self.store.reserve(tenant, reservation, limits, tokens)
        except StateUnavailable:
            if self.config.state.quota_on_failure == "closed":
                self.metrics.quota_unavailable.labels("refused").inc()
                raise
            self.metrics.quota_unavailable.labels("admitted").inc()
            return None
        label = self.metrics.tenant_label(tenant)
        if not decision.admitted:
            assert decision.refused_by is not None
            self.metrics.quota_rejections.labels(label, decision.refused_by).inc()
            raise refusal(decision, anthropic=anthropic)
        reserved = max((limit.wanted(tokens) for limit in limits if limit.tokens), default=0)
        self._held[reservation] = _Held(tenant, limits, reserved, prompt)
        self.metrics.quota_reserved.labels(label).inc(reserved)
        return decision

    def on_outcome(self, outcome: Outcome) -> None:
        """The request ended: settle its reservation, if it holds one (an outcome subscriber)."""
        held = self._held.pop(outcome.request_id, None) if outcome.request_id is not None else None
        if held is None:
            return
        self.metrics.quota_reserved.labels(self.metrics.tenant_label(held.tenant)).dec(held.reserved)
        assert outcome.request_id is not None
        task = asyncio.ensure_future(self._settle(held, outcome.request_id, charged(outcome, held.prompt), outcome.cut))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(
        self, held: _Held, reservation: str, used: int | None, cut: asyncio.Future[Tokens | None] | None = None
    ) -> None:
        if cut is not None:
            used = await _with_cut(used, cut)
        for delay in (*SETTLE_DELAYS_S, None):
            try:
                await self.store.settle(held.tenant, reservation, held.limits, used)
                return
            except StateUnavailable:
                if delay is None:
                    break
                self.metrics.quota_unavailable.labels("settle_retried").inc()
                await asyncio.sleep(delay)  # the store is down: try again later
        self.metrics.quota_unavailable.labels("settle_failed").inc()
        log.warning("a quota reservation of tenant %r was not settled: the store is unavailable", held.tenant)

    async def close(self) -> None:
        """Let settles in flight finish (briefly), then close the store."""
        pending = list(self._settling)
        if pending:
            await asyncio.wait(pending, timeout=self.config.state.timeout_s * 2)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.store.close()


async def _with_cut(used: int | None, cut: asyncio.Future[Tokens | None]) -> int | None:
    """`used`, or what the cut request's engines said it used when that is more (the tokens
    a client was sent are fewer than were generated when it left mid-stream)."""
    try:
        async with asyncio.timeout(CUT_USAGE_WAIT_S):
            engines = await asyncio.shield(cut)
    except TimeoutError:
        return used
    if engines is None:
        return used
    spent = engines.prompt + engines.completion
    return spent if used is None else max(used, spent)


def charged(outcome: Outcome, prompt: int) -> int | None:
    """What a request pays (None: its reservation stands)."""
    tokens = outcome.tokens
    if tokens is not None:
        return tokens.prompt + tokens.completion
    if outcome.status >= 400 and not outcome.client_gone and not outcome.stream_error:
        return prompt  # refused or failed before the first byte: no completion was sent
    return None


def refusal(decision: Decision, *, anthropic: bool) -> QuotaExceeded:
    """The 429 for a refused reserve, with the API's rate-limit headers and `Retry-After`."""
    name = decision.refused_by
    wait = openai_duration(decision.retry_after_s)
    error = QuotaExceeded(f"this tenant's {name} quota is used up; it will admit this request in {wait}")
    error.type = "requests" if name == "requests_per_minute" else "tokens"
    error.headers = quota_headers(decision, anthropic=anthropic)
    return error
