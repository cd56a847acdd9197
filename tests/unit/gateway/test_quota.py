"""Tenant quota buckets in memory (`gateway.edge.quota`), their headers and their config:
the arithmetic on a clock the test moves."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from opentelemetry.trace import INVALID_SPAN

from gateway.config import ConfigError, Tenant, load_config
from gateway.edge.quota import Limit, MemoryQuotas, limits_of
from gateway.edge.quota_check import UNBOUNDED, charged, request_tokens
from gateway.observe.outcome import CLIENT_GONE, Outcome, Tokens
from gateway.edge.quota_headers import openai_duration, quota_headers, rfc3339


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


TPM = Limit("tokens_per_minute", 600, 60.0)  # refills 10 tokens a second
RPM = Limit("requests_per_minute", 2, 60.0)


async def test_a_reserve_takes_from_every_bucket_or_from_none() -> None:
    clock = Clock()
    quotas = MemoryQuotas(clock)
    first = await quotas.reserve("a", "r1", [TPM, RPM], 400)
    assert first.admitted
    assert [(level.limit.name, level.remaining) for level in first.levels] == [
        ("tokens_per_minute", 200),
        ("requests_per_minute", 1),
    ]
    assert first.levels[0].reset_s == pytest.approx(40.0)  # 400 tokens at 10 a second
    refused = await quotas.reserve("a", "r2", [TPM, RPM], 300)  # 100 short: 10 s
    assert not refused.admitted and refused.refused_by == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(10.0)
    assert (await quotas.reserve("a", "r3", [TPM, RPM], 200)).admitted  # the refusal took nothing
    out_of_requests = await quotas.reserve("a", "r4", [TPM, RPM], 1)
    assert out_of_requests.refused_by == "requests_per_minute"
    assert out_of_requests.retry_after_s == pytest.approx(30.0)  # 2 a minute: one in 30 s
    assert (await quotas.reserve("b", "r5", [TPM, RPM], 600)).admitted  # another tenant's own buckets


async def test_buckets_refill_continuously_up_to_their_capacity() -> None:
    clock = Clock()
    quotas = MemoryQuotas(clock)
    assert (await quotas.reserve("a", "r1", [TPM], 600)).admitted
    clock.now += 15.0  # 150 back
    assert not (await quotas.reserve("a", "r2", [TPM], 151)).admitted
    assert (await quotas.reserve("a", "r3", [TPM], 150)).admitted
    clock.now += 3600.0
    decision = await quotas.reserve("a", "r4", [TPM], 1)
    assert decision.levels[0].remaining == 599  # full again, never above the capacity


async def test_a_settle_charges_the_usage_once_and_may_leave_a_debt() -> None:
    clock = Clock()
    quotas = MemoryQuotas(clock)
    assert (await quotas.reserve("a", "r1", [TPM, RPM], 500)).admitted
    assert await quotas.settle("a", "r1", [TPM, RPM], 100)  # 400 given back
    assert not await quotas.settle("a", "r1", [TPM, RPM], 100)  # a retried settle changes nothing
    decision = await quotas.reserve("a", "r2", [TPM], 500)
    assert decision.admitted and decision.levels[0].remaining == 0
    # A request bigger than the bucket is reserved as the bucket; its real usage is charged.
    clock.now += 60.0
    big = await quotas.reserve("a", "r3", [TPM], UNBOUNDED)
    assert big.admitted and big.levels[0].remaining == 0
    assert await quotas.settle("a", "r3", [TPM], 900)  # 300 over: a debt
    refused = await quotas.reserve("a", "r4", [TPM], 1)
    assert not refused.admitted and refused.retry_after_s == pytest.approx(30.1)  # 301 tokens at 10 a second
    assert refused.levels[0].reset_s == pytest.approx(90.0)


async def test_a_settle_without_usage_leaves_the_reservation_charged() -> None:
    clock = Clock()
    quotas = MemoryQuotas(clock)
    assert (await quotas.reserve("a", "r1", [TPM], 500)).admitted
    assert await quotas.settle("a", "r1", [TPM], None)
    assert not await quotas.settle("a", "r1", [TPM], 0)
    assert not (await quotas.reserve("a", "r2", [TPM], 101)).admitted


def test_a_request_reserves_its_prompt_and_its_completion_budget() -> None:
    prompts = [[1] * 10, [1] * 20]
    assert request_tokens(prompts, 2, 5, 100) == 10 + 20 + 2 * (5 + 5)
    assert request_tokens(prompts, 1, None, 100) == 10 + 20 + 90 + 80  # what the context leaves
    assert request_tokens(prompts, 1, 1000, 100) == 10 + 20 + 90 + 80  # capped by it, as engines cap
    assert request_tokens([[1] * 10], 1, None, None) == 10 + UNBOUNDED


def test_limits_are_divided_among_workers() -> None:
    tenant = Tenant(tokens_per_minute=1000, requests_per_minute=3, tokens_per_day=10_000)
    assert [(limit.name, limit.capacity, limit.window_s) for limit in limits_of(tenant, share=2)] == [
        ("tokens_per_minute", 500, 60.0),
        ("tokens_per_day", 5000, 86400.0),
        ("requests_per_minute", 1, 60.0),
    ]
    assert limits_of(Tenant()) == ()


def test_durations_are_written_as_openai_writes_them() -> None:
    assert [openai_duration(s) for s in (0.02, 0.0001, 1.0, 1.5, 8.64, 360.0, 7260.0)] == [
        "20ms", "1ms", "1s", "1.5s", "8.64s", "6m0s", "2h1m0s",
    ]  # fmt: skip
    assert rfc3339(1.2, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2026-01-02T03:04:07Z"


async def test_the_headers_name_the_refusing_token_limit_and_retry_after() -> None:
    quotas = MemoryQuotas(Clock())
    day = Limit("tokens_per_day", 100, 86_400.0)
    assert (await quotas.reserve("a", "r1", [TPM, day, RPM], 50)).admitted
    refused = await quotas.reserve("a", "r2", [TPM, day, RPM], 60)
    assert refused.refused_by == "tokens_per_day"
    openai = quota_headers(refused, anthropic=False)
    assert openai["x-ratelimit-limit-tokens"] == "100" and openai["x-ratelimit-remaining-tokens"] == "50"
    assert openai["x-ratelimit-limit-requests"] == "2" and openai["x-ratelimit-reset-requests"] == "30s"
    assert openai["Retry-After"] == "8640"  # 10 tokens at 100 a day
    anthropic = quota_headers(refused, anthropic=True)
    assert set(anthropic) == {
        "anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-limit",
        "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset", "Retry-After",
    }  # fmt: skip
    admitted = await quotas.reserve("a", "r3", [TPM, RPM], 100)
    assert "Retry-After" not in quota_headers(admitted, anthropic=False)
    assert quota_headers(admitted, anthropic=False)["x-ratelimit-remaining-tokens"] == "450"


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("{tokens_per_minute: -5}", "Expected `int` >= 1 - at `$.tenants['beta'].tokens_per_minute`"),
        ("{tokens_per_day: 1e30}", "at `$.tenants['beta'].tokens_per_day`"),
        ("{requests_per_minute: 100000000000}", "Expected `int` <= 10000000 - at `$.tenants['beta'].requests_per_minute`"),
        ("{tokens_per_hour: 5}", "unknown field `tokens_per_hour` - at `$.tenants['beta']`"),
    ],
)
def test_a_negative_or_absurd_quota_is_refused_naming_the_tenant_and_field(
    tmp_path: Path, entry: str, said: str
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "model: m\ntokenizer: t\nengines: [{url: 'http://127.0.0.1:1'}]\n"
        f"tenants:\n  alpha: {{tokens_per_minute: 100}}\n  beta: {entry}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert said in str(caught.value)


def _outcome(status: int, tokens: Tokens | None) -> Outcome:
    return Outcome(
        request_id="r", endpoint="chat", model="m", tenant="a", route="text", status=status, error=None,
        finish_reasons=(), tokens=tokens, duration_s=0.0, span=INVALID_SPAN,
    )  # fmt: skip


def test_a_request_pays_its_usage_else_its_prompt_on_an_error_else_its_reservation() -> None:
    assert charged(_outcome(200, Tokens(prompt=10, cached=4, completion=5)), prompt=10) == 15
    assert charged(_outcome(503, None), prompt=10) == 10  # refused before the first byte
    assert charged(_outcome(CLIENT_GONE, None), prompt=10) is None  # left mid-stream: the reservation stands
    # A stream that failed mid-way (counted under its error's status): part of its completion was sent.
    failed = msgspec.structs.replace(_outcome(502, None), error="EngineDied", stream_error=True)
    assert charged(failed, prompt=10) is None
