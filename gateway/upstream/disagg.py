"""Prefill/decode disaggregation, orchestrated by the gateway as vLLM's serving expects.

With `prefill_engines` configured, a request (each prompt of a completion) first goes to a prefill
engine (typically `--tokens-only`): the rendered prompt, `max_tokens=1`,
`n=1`, and `kv_transfer_params` asking for remote decode. Its answer's
`kv_transfer_params` (where the KV cache is and how to pull it) go, untouched,
into the decode request, which carries the route's `output_mode` and the
client's sampling. A client that leaves is aborted on both engines.
"""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry.trace import Span

from gateway.routing.picker import RequestFacts
from gateway.upstream.engine_client import EngineClient
from gateway.upstream.engine_request import generate_body
from gateway.edge.errors import EngineFailed
from gateway.observe.spans import stage

PREFILL_KV: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill request asks the engine's KV connector for (vLLM's shape)."""


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


async def prefill(
    engines: EngineClient, tracer: Any, facts: RequestFacts, request_id: str, parent: Span, on_engine: Any
) -> dict[str, Any]:
    """Run the prefill of `facts.prompt` on the prefill pool's engine for it (with kv_cache
    balancing, the one whose cache saves the most); the decode request's `kv_transfer_params`.

    `on_engine(url)` learns the prefill engine as soon as it answers, so an abort
    can reach it."""
    body = generate_body(
        request_id=request_id,
        model=None,
        prompt_ids=facts.prompt or (),
        sampling={"n": 1, "max_tokens": 1},
        route="tokens",
        stream=False,
        kv_transfer_params=PREFILL_KV,
        cache_salt=facts.cache_salt,
        priority=facts.priority,
    )
    with stage(tracer, "prefill", parent) as span:
        choice = engines.pick(facts)
        if choice.why is not None:
            span.set_attribute("onehop.engine.choice", choice.why)
        async with engines.open(
            choice, body, stream=False, request_id=request_id, parent=span, facts=facts
        ) as (url, response):
            on_engine(url)
            raw = await response.read()
        try:
            params = _ANSWER.decode(raw).kv_transfer_params
        except msgspec.DecodeError as exc:
            raise EngineFailed(f"the prefill engine sent an invalid answer: {exc}") from exc
        if not params:
            raise EngineFailed("the prefill engine returned no kv_transfer_params (is a KV connector configured?)")
        span.set_attribute("onehop.engine.endpoint", url)
        return params
