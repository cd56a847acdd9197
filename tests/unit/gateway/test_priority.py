"""A request's priority (`gateway.edge.priority`): vLLM's header first, then a non-zero body
field, capped by the tenant's allowance."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.config import Tenant
from gateway.edge.priority import asked, effective


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, 0, None),  # vLLM's default: nothing asked
        ({}, 3, 3),
        ({"x-vllm-priority": "-2"}, 3, -2),  # the header first, as vLLM reads it
        ({"X-Vllm-Priority": "0"}, 3, 0),  # an explicit 0 in the header is an ask
        ({"X-Vllm-Priority": "urgent"}, 4, 4),  # not a number: ignored, as vLLM ignores it
        ({"X-Vllm-Priority": str(2**63)}, 0, None),  # past 64 bits: ignored
        ({"X-Vllm-Priority": "1" * 400}, 0, None),  # never parsed at length
    ],
)
def test_the_ask(headers: dict[str, str], body: int, expected: int | None) -> None:
    assert asked(CIMultiDict(headers), body) == expected


def test_an_ask_is_capped_by_the_tenants_allowance_never_refused() -> None:
    plain, allowed = Tenant(priority=2), Tenant(priority=2, best_priority=-3)
    assert [effective(plain, ask) for ask in (None, 5, 2, -100)] == [2, 5, 2, 2]
    assert [effective(allowed, ask) for ask in (None, 5, -1, -100)] == [2, 5, -1, -3]
