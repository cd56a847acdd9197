"""What one engine process holds for its life: backend, tokenizer tables, metrics, running requests."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from engine.backends.base import Backend
from engine.backends.vllm_parsers import owners
from engine.config import EngineConfig
from derender.vocab import TokenVocab
from engine.metrics import EngineMetrics
from engine.writer_context import WriterContext
from plumbing.telemetry import Tracing, TracingConfig
from wire.protocol import EngineSummary

ENDED_KEPT = 4096
"""How many ended requests' summaries an engine keeps for `/abort_requests` to answer with
(~200 bytes each): an abort comes within moments of its request's end, thousands of
requests later only at thousands of requests a second."""


@dataclass
class RunningRequest:
    request_id: str
    mode: str
    aborted: bool = False
    """Set by `/abort_requests`; the stream then ends its open choices with `abort`."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the request has stopped and its summary is in `EngineState.ended`."""


class EndedRequests:
    """The summaries of the last `ENDED_KEPT` requests that ended, by their whole id (abort
    handle included, so only the gateway that drew it can read one)."""

    def __init__(self, kept: int = ENDED_KEPT) -> None:
        self._kept = kept
        self._summaries: OrderedDict[str, EngineSummary] = OrderedDict()

    def add(self, request_id: str, summary: EngineSummary) -> None:
        self._summaries[request_id] = summary
        if len(self._summaries) > self._kept:
            self._summaries.popitem(last=False)

    def get(self, request_id: str) -> EngineSummary | None:
        return self._summaries.get(request_id)


@dataclass
class EngineState:
    config: EngineConfig
    backend: Backend
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    tracing: Tracing = field(default_factory=lambda: Tracing(TracingConfig(), "onehop-engine"))
    vocab: TokenVocab | None = None
    """None until the tokenizer is loaded, and always None with `tokens_only`."""
    running: dict[str, RunningRequest] = field(default_factory=dict)
    ended: EndedRequests = field(default_factory=EndedRequests)
    ready: bool = False
    parser_choice: str = "configured"
    """How the parser names were settled (`configured`, or what `auto` detection saw)."""

    def parsers(self) -> dict[str, str]:
        """The parsers this engine serves, by name, and who runs them (`onehop` or `vllm`)."""
        return dict(owners(self.config.reasoning_parser, self.config.tool_parser))

    @property
    def model(self) -> str:
        return self.backend.info.model

    def writer_context(self) -> WriterContext:
        return WriterContext(
            model=self.model,
            vocab=self.vocab,
            reasoning_parser=self.config.reasoning_parser,
            tool_parser=self.config.tool_parser,
            reasoning_field=self.config.reasoning_field,
        )


ENGINE = web.AppKey("engine", EngineState)
