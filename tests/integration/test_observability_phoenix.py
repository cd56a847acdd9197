"""Traces as a user sees them in a real LLM trace UI: a gateway and a sim engine export OTLP to
Arize Phoenix (`phoenix serve` from its own venv), requests go through the real OpenAI and
Anthropic SDKs, and the spans are read back through Phoenix's own REST API.

Each request is one trace joining the gateway's and the engine's spans (a caller's
`traceparent` continued), Phoenix sees exactly one LLM call in it (the gateway's request span;
the engine's span is not another), with the tokens the client was told, and the answer's
`traceresponse` header names that trace.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from plumbing.telemetry import TracingConfig
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server
from tests.support.observed_traffic import Sent, Traffic
from tests.support.phoenix_server import Phoenix, StoredSpan, phoenix_server

pytestmark = [pytest.mark.observability, pytest.mark.asyncio(loop_scope="module")]

ENGINE_SPAN = "POST /inference/v1/generate"
CALLER_TRACE, CALLER_SPAN = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"
STORED_S = 30.0
"""Longest wait for Phoenix to store what the exporters flushed (it inserts in batches)."""
TRACE_HEADER = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


@dataclass
class Traced:
    sent: list[Sent]
    traces: list[list[StoredSpan]]
    """One list of spans per trace, in the order their first span started."""


async def _send(traffic: Traffic) -> None:
    await traffic.chat("anyone", "derender", stream=False)
    await traffic.chat("anyone", "text", stream=True, tools=True)
    await traffic.completion("anyone", "tokens", stream=False)
    await traffic.response("anyone", "derender", stream=True)
    await traffic.response("anyone", "tokens", stream=False)
    await traffic.message("anyone", "derender", stream=False)
    await traffic.message("anyone", "text", stream=True)
    await traffic.chat("anyone", "derender", stream=True, headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})


def _by_trace(spans: list[StoredSpan]) -> list[list[StoredSpan]]:
    traces: dict[str, list[StoredSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        traces.setdefault(span.trace_id, []).append(span)
    return list(traces.values())


async def _stored(phoenix: Phoenix, requests: int) -> list[list[StoredSpan]]:
    """Until Phoenix holds a trace per request with the engine's span in each."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STORED_S
    while True:
        traces = _by_trace(await phoenix.spans())
        joined = [t for t in traces if any(s.name == ENGINE_SPAN for s in t) and _root(t) is not None]
        if len(joined) >= requests:
            return traces
        if loop.time() >= deadline:
            raise AssertionError(f"Phoenix holds {len(joined)} joined traces of {requests} after {STORED_S} s")
        await asyncio.sleep(0.2)  # polling its API: it inserts in the background and tells no one


def _root(trace: list[StoredSpan]) -> StoredSpan | None:
    """The gateway's request span: the one whose parent is not in the trace (none, or the caller's)."""
    ids = {s.span_id for s in trace}
    roots = [s for s in trace if s.parent_id not in ids]
    return roots[0] if len(roots) == 1 else None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Traced]:
    async with phoenix_server(tmp_path_factory.mktemp("phoenix")) as phoenix:
        tracing = TracingConfig(endpoint=phoenix.otlp_http)
        async with AsyncExitStack() as stack:
            engine_url, _ = await stack.enter_async_context(engine_server(qwen3_tokenizer_dir, tracing=tracing))
            base_url, _ = await stack.enter_async_context(gateway_server(qwen3_tokenizer_dir, engine_url, tracing=tracing))
            traffic = Traffic(base_url, {"anyone": "unused"}, stack)
            await _send(traffic)
        # Both apps are shut down, and with them their exporters: every span was flushed.
        yield Traced(traffic.ledger.sent, await _stored(phoenix, len(traffic.ledger.sent)))


async def test_one_joined_trace_per_request(traced: Traced) -> None:
    assert len(traced.traces) == len(traced.sent)
    for trace in traced.traces:
        root = _root(trace)
        assert root is not None, [s.name for s in trace]
        (engine,) = [s for s in trace if s.name == ENGINE_SPAN]
        assert engine.parent_id in {s.span_id for s in trace}  # under the gateway's client span


async def test_a_callers_traceparent_is_continued(traced: Traced) -> None:
    last = traced.traces[-1]  # the requests went one after another, the caller's last
    root = _root(last)
    assert root is not None
    assert (root.trace_id, root.parent_id) == (CALLER_TRACE, CALLER_SPAN)


async def test_exactly_one_llm_span_per_request_the_gateways(traced: Traced) -> None:
    for trace in traced.traces:
        llm = [s for s in trace if s.kind == "LLM"]
        assert llm == [_root(trace)], [(s.name, s.kind) for s in trace]
        (engine,) = [s for s in trace if s.name == ENGINE_SPAN]
        counted = [k for k in engine.attributes if k.startswith(("llm.token_count", "gen_ai.usage"))]
        assert not counted, f"the engine's span counts tokens too: {counted}"


async def test_token_totals_are_the_usage_the_clients_got(traced: Traced) -> None:
    for sent, trace in zip(traced.sent, traced.traces, strict=True):
        root = _root(trace)
        assert root is not None and sent.usage is not None
        a = root.attributes
        told = (a.get("llm.token_count.prompt"), a.get("llm.token_count.completion"))
        assert told == (sent.usage.prompt, sent.usage.completion), (sent.endpoint, sent.route, root.name)
    # What Phoenix's project page adds up: every LLM span's total.
    total = sum(s.attributes.get("llm.token_count.total", 0) for t in traced.traces for s in t if s.kind == "LLM")
    assert total == sum(s.usage.prompt + s.usage.completion for s in traced.sent if s.usage is not None)


async def test_every_answer_names_its_trace(traced: Traced) -> None:
    for sent, trace in zip(traced.sent, traced.traces, strict=True):
        assert sent.trace_header is not None, f"no traceresponse header on the {sent.endpoint} answer"
        found = TRACE_HEADER.match(sent.trace_header)
        assert found is not None, sent.trace_header
        assert found.group(1) == trace[0].trace_id
        assert found.group(2) in {s.span_id for s in trace}
