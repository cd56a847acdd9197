"""A request's life in the hf backend: its rows (one per choice), its outbox, a step's result.

The event loop registers, releases and delivers (`backend.py`); the worker thread appends
sampled tokens and decides, per row, when a choice is done (`accept`, in vLLM's order).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from engine.backends.base import BackendOutput, BackendRequest, FinishReason
from engine.backends.grammar import ChoiceGrammar
from engine.backends.hf.plan import Plan
from wire.protocol import GenerateLogProbsContent


class Outbox:
    """A request's undelivered output, merged per choice so a slow consumer never queues steps."""

    __slots__ = ("_ended", "_error", "_pending", "_ready")

    def __init__(self) -> None:
        self._pending: dict[int, BackendOutput] = {}
        self._error: BaseException | None = None
        self._ended = False
        self._ready = asyncio.Event()

    def put(self, output: BackendOutput) -> None:
        held = self._pending.get(output.index)
        if held is None:
            self._pending[output.index] = output
        else:
            held.token_ids.extend(output.token_ids)
            if held.logprobs is not None and output.logprobs is not None:
                held.logprobs.extend(output.logprobs)
            held.finish_reason, held.stop_reason = output.finish_reason, output.stop_reason
        self._ready.set()

    def end(self) -> None:
        self._ended = True
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> list[BackendOutput] | None:
        """The next merged outputs; None once the request ended; raises the request's error."""
        while not self._pending and not self._ended and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending:
            outputs = list(self._pending.values())
            self._pending = {}
            return outputs
        if self._error is not None:
            raise self._error
        return None


@dataclass(slots=True, eq=False)
class RequestState:
    request: BackendRequest
    plan: Plan
    prompt: torch.Tensor  # [1, prompt length] on the model's device
    outbox: Outbox = field(default_factory=Outbox)
    rows: list[Row] = field(default_factory=list)
    gone: bool = False  # aborted, closed by its consumer, or the backend is closing
    released: asyncio.Event = field(default_factory=asyncio.Event)
    registered: float = field(default_factory=time.monotonic)
    queued_s: float | None = None  # set when it joins the batch


@dataclass(slots=True, eq=False)
class Row:
    """One choice of a request: one row of the batch."""

    owner: RequestState
    index: int
    generator: torch.Generator | None  # None: torch's global RNG (no seed asked for)
    output_ids: list[int] = field(default_factory=list)
    grammar: ChoiceGrammar | None = None  # structured outputs (made by `HFBackend.prepare`)
    finished: bool = False  # no more tokens to sample (set on the worker thread)
    reported: bool = False  # its finish_reason reached the consumer's outbox (set on the event loop)

    def next_position(self) -> int:
        """The position of this row's last sampled token, which the next decode step feeds."""
        return self.owner.prompt.shape[1] + len(self.output_ids) - 1

    def shapes(self) -> bool:
        """Whether this row's logits need changing before sampling."""
        plan = self.owner.plan
        return (
            plan.always_shapes
            or (plan.early_stop_ids is not None and len(self.output_ids) < plan.min_tokens)
            or (self.grammar is not None and self.grammar.active)
        )


@dataclass(slots=True)
class Emitted:
    row: Row
    token: int
    logprobs: GenerateLogProbsContent | None
    finish_reason: FinishReason | None
    stop_reason: int | None


@dataclass(slots=True)
class StepResult:
    emitted: list[Emitted] = field(default_factory=list)
    failed: dict[int, tuple[RequestState, Exception]] = field(default_factory=dict)  # by id(request)

    def fail(self, request: RequestState, error: Exception) -> None:
        self.failed.setdefault(id(request), (request, error))


def accept(row: Row, token: int, logprobs: GenerateLogProbsContent | None) -> Emitted:
    """Append a sampled token to its row and decide whether the row is done (vLLM's check order)."""
    plan = row.owner.plan
    row.output_ids.append(token)
    if row.grammar is not None:
        row.grammar.accept(token)
    count = len(row.output_ids)
    finish: FinishReason | None = None
    stop: int | None = None
    if count >= plan.min_tokens and token in plan.eos_ids:
        finish = "stop"
    elif count >= plan.min_tokens and token in plan.stop_ids:
        finish, stop = "stop", token
    elif count >= plan.max_tokens:
        finish = "length"
    row.finished = finish is not None
    return Emitted(row, token, logprobs, finish, stop)
