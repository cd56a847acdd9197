"""The hf backend itself: lifecycle, admission and the scheduler that drives each step.

A request moves through three states, all changed on the event loop:

    waiting   registered by generate(), not yet prefilled
    running   its rows (one per choice) sit in the batch, one token per decode step
    released  finished, aborted, closed by its consumer or failed; nothing more
              is generated and running() no longer lists it

Each scheduler iteration is one step boundary. Rows whose request went away
are dropped, then one decode forward pass advances every row in the batch by
one token, then the waiting requests that fit are prefilled (each alone) and
join the batch (`batch.py`).

Tensor work (load, prefill, joins, decode, sampling) runs on one worker
thread so the event loop stays free. The scheduler awaits each call, so only
that thread touches the batch while it runs; the event loop only sets flags.
Structured-output grammars are compiled before a request registers, in a check
process and then on a thread of their own (`grammar_check`), so neither a
constraint that crashes the grammar library nor a slow one stops the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from engine.backends.base import (
    BackendError,
    BackendInfo,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
)
from engine.backends.checks import check_prompt, request_eos
from engine.backends.grammar import ChoiceGrammar, GrammarTokenizer
from engine.backends.grammar_check import GrammarCheck, compile_executor
from engine.backends.hf.batch import Batch
from engine.backends.hf.model import HFBackendConfig, load_model, load_tokenizer, read_info
from engine.backends.hf.plan import generators, make_plan
from engine.backends.hf.sampling import sample
from engine.backends.hf.state import RequestState, Row, StepResult, accept
from wire.grammar_compile import GrammarError, compile_grammar
from wire.protocol import StructuredOutputs

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class HFBackend:
    """A `Backend` running a transformers causal LM with continuous batching."""

    def __init__(self, config: HFBackendConfig) -> None:
        self._config = config
        self._info: BackendInfo | None = None
        self._model: Any = None
        self._device = torch.device("cpu")
        self._executor: ThreadPoolExecutor | None = None
        self._requests: dict[str, RequestState] = {}
        self._waiting: deque[RequestState] = deque()
        self._batch = Batch()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._grammar_check = GrammarCheck(config.grammar_timeout_s)
        self._grammar_executor: ThreadPoolExecutor | None = None

    @property
    def info(self) -> BackendInfo:
        # Read lazily so constructing a backend touches no files; start() reads it off the loop.
        if self._info is None:
            self._info = read_info(self._config)
        return self._info

    async def start(self) -> None:
        if self._task is not None:
            raise BackendError("the hf backend is already started")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="onehop-hf", initializer=self._init_thread)
        try:
            self._info = await self._in_thread(read_info, self._config)
            self._model, self._device = await self._in_thread(load_model, self._config)
            if self._info.constraints:
                tokenizer = await self._in_thread(load_tokenizer, Path(self._config.model))
                self._grammar_tokenizer = GrammarTokenizer(tokenizer, self._info.vocab_size)
                # Built now, before serving: building it holds the GIL for seconds (4 s of 7
                # measured on this project's CPUs), which would stall the event loop mid-serving.
                await self._in_thread(self._grammar_tokenizer.get)
                self._grammar_executor = compile_executor()
                await self._grammar_check.start()
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            await self._close_grammar()
            raise
        self._task = asyncio.create_task(self._schedule(), name="onehop-hf-scheduler")

    def _init_thread(self) -> None:
        if self._config.threads is not None:
            torch.set_num_threads(self._config.threads)

    async def _in_thread(self, work: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._release_all()
        self._batch = Batch()
        self._model = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        await self._close_grammar()

    async def _close_grammar(self) -> None:
        await self._grammar_check.close()
        if self._grammar_executor is not None:
            self._grammar_executor.shutdown(wait=False)
            self._grammar_executor = None

    def running(self) -> frozenset[str]:
        return frozenset(self._requests)

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        self._abandon(state)
        # Returns once the scheduler has dropped the rows: at most one step away.
        await state.released.wait()

    async def prepare(self, request: BackendRequest) -> BackendRequest:
        """With structured outputs: one grammar matcher per choice, compiled first in the check
        process (a constraint that crashes the library kills that, not this engine), then
        here on the compile thread, never on the event loop (`grammar_check`)."""
        constraint = request.sampling.structured_outputs
        if constraint is None or request.prepared is not None:
            return request
        if constraint.kind not in self.info.constraints or self._grammar_executor is None:
            raise BackendRequestError(
                f"this model folder has no tokenizer: structured_outputs.{constraint.kind} cannot be enforced"
            )
        await self._grammar_check.check(constraint)
        matchers = await asyncio.get_running_loop().run_in_executor(
            self._grammar_executor, self._matchers, constraint, request.sampling.n, request.reasoning_end_ids
        )
        return dataclasses.replace(request, prepared=matchers)

    def _matchers(self, constraint: StructuredOutputs, n: int, waiting: frozenset[int] | None) -> list[ChoiceGrammar]:
        assert self._grammar_tokenizer is not None  # the executor exists only with it
        try:
            grammar = compile_grammar(constraint)
        except GrammarError as exc:
            raise BackendRequestError(str(exc)) from exc  # the client's fault: a 400
        first = ChoiceGrammar(self._grammar_tokenizer, grammar, waiting)
        return [first] + [first.copy() for _ in range(n - 1)]

    async def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        request = await self.prepare(request)  # a no-op when the engine prepared it
        state = self._register(request)
        try:
            while (outputs := await state.outbox.get()) is not None:
                yield outputs
        except (GeneratorExit, asyncio.CancelledError):
            self._abandon(state)  # the consumer is gone: its rows leave at the next step boundary
            raise

    # ---------------------------------------------------- admission (event loop)

    def _register(self, request: BackendRequest) -> RequestState:
        if self._task is None or self._task.done() or self._closing:
            raise BackendError("the hf backend is not running")
        info = self.info
        check_prompt(request, info, self._requests)
        ids = request.prompt_token_ids
        n = request.sampling.n
        if n > self._config.max_batch_size:
            raise BackendRequestError(f"n={n} is more than max_batch_size={self._config.max_batch_size}")
        plan = make_plan(request, info, self._device, request_eos(request, info))
        prompt = torch.tensor([list(ids)], dtype=torch.long, device=self._device)
        state = RequestState(request, plan, prompt)
        state.rows = [Row(state, i, g) for i, g in enumerate(generators(plan.seed, n, self._device))]
        if isinstance(request.prepared, list):
            for row, matcher in zip(state.rows, request.prepared, strict=True):
                row.grammar = matcher
        self._requests[request.request_id] = state
        self._waiting.append(state)
        self._wake.set()
        return state

    def _abandon(self, state: RequestState) -> None:
        if state.released.is_set():
            return
        state.gone = True
        if state in self._waiting:
            self._waiting.remove(state)
            self._release(state)
        else:
            self._wake.set()

    def _release(self, state: RequestState) -> None:
        """Take a request out of the backend; unfinished choices end with finish_reason "abort"."""
        if state.released.is_set():
            return
        for row in state.rows:
            row.finished = True
            if not row.reported:
                row.reported = True
                state.outbox.put(BackendOutput(index=row.index, token_ids=[], finish_reason="abort"))
        state.outbox.end()
        self._requests.pop(state.request.request_id, None)
        state.released.set()

    def _release_all(self) -> None:
        self._waiting.clear()
        for state in list(self._requests.values()):
            state.gone = True
            self._release(state)

    def _fail(self, state: RequestState, error: BackendError) -> None:
        if state.released.is_set():
            return
        for row in state.rows:
            row.finished = row.reported = True
        state.outbox.fail(error)
        self._requests.pop(state.request.request_id, None)
        state.released.set()

    # ---------------------------------------------------- scheduling (event loop)

    async def _schedule(self) -> None:
        try:
            while not self._closing:
                keep = self._boundary()
                joining = self._admit(len(keep))
                if not keep and not joining:
                    self._batch.clear()  # no thread is running, so dropping the tensors here is safe
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._deliver(await self._in_thread(self._work, keep, joining))
        except Exception as exc:
            # A bug here, not a model failure (those come back in the step result).
            logger.exception("the hf scheduler stopped")
            for state in list(self._requests.values()):
                self._fail(state, BackendError(f"the hf scheduler stopped: {exc}"))
        finally:
            self._release_all()

    def _boundary(self) -> list[int]:
        """Release requests that went away; the batch positions of the rows that go on."""
        keep = []
        for position, row in enumerate(self._batch.rows):
            if row.owner.gone:
                self._release(row.owner)
            elif not row.finished:
                keep.append(position)
        return keep

    def _admit(self, running: int) -> list[RequestState]:
        room = self._config.max_batch_size - running
        joining: list[RequestState] = []
        # First come, first served: a wide n>1 request at the head is not overtaken.
        while self._waiting and len(self._waiting[0].rows) <= room:
            state = self._waiting.popleft()
            state.queued_s = time.monotonic() - state.registered
            joining.append(state)
            room -= len(state.rows)
        return joining

    def _deliver(self, result: StepResult) -> None:
        touched: dict[int, RequestState] = {}
        for item in result.emitted:
            owner = item.row.owner
            if owner.gone:
                # Went away during the step: its tokens are dropped. A request
                # whose choices all ended at prefill never joined the batch,
                # so the next boundary would not see it: release it here.
                self._release(owner)
                continue
            logprobs = [item.logprobs] if item.logprobs is not None else None
            owner.outbox.put(
                BackendOutput(
                    item.row.index,
                    [item.token],
                    logprobs,
                    item.finish_reason,
                    item.stop_reason,
                    queued_s=owner.queued_s,
                )
            )
            item.row.reported = item.finish_reason is not None
            touched[id(owner)] = owner
        for owner in touched.values():
            if all(row.reported for row in owner.rows):
                self._release(owner)
        for owner, error in result.failed.values():
            self._fail(owner, BackendError(f"the model failed to generate: {error}"))

    # ---------------------------------------------------- tensor work (worker thread)

    def _work(self, keep: list[int], joining: list[RequestState]) -> StepResult:
        result = StepResult()
        with torch.inference_mode():
            self._batch.retain(keep)
            if self._batch.rows:
                self._decode(result)
            pieces = [piece for state in joining if (piece := self._prefill(state, result)) is not None]
            try:
                self._batch.join(pieces)
            except Exception as exc:  # out of memory, most likely: every row is suspect
                self._fail_batch(result, exc, [row.owner for rows, _ in pieces for row in rows])
        return result

    def _decode(self, result: StepResult) -> None:
        batch = self._batch
        try:
            ids, positions, mask = batch.decode_inputs(self._model.dtype)
            out = self._model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=batch.cache, use_cache=True
            )
            tokens, logprobs = sample(self._logits(out.logits), batch.rows)
        except Exception as exc:
            # The cache may be half updated: drop the whole batch.
            self._fail_batch(result, exc, [row.owner for row in batch.rows])
            return
        result.emitted.extend(accept(row, t, lp) for row, t, lp in zip(batch.rows, tokens, logprobs, strict=True))

    def _fail_batch(self, result: StepResult, error: Exception, owners: list[RequestState]) -> None:
        for owner in owners + [row.owner for row in self._batch.rows]:
            result.fail(owner, error)
        self._batch.clear()

    def _prefill(self, state: RequestState, result: StepResult) -> tuple[list[Row], DynamicCache] | None:
        """Run one prompt alone, sample each choice's first token; the rows that go on, with their cache."""
        try:
            cache = DynamicCache(config=self._model.config)
            out = self._model(input_ids=state.prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = self._logits(out.logits).expand(len(state.rows), -1)
            tokens, logprobs = sample(logits, state.rows)
            result.emitted.extend(accept(row, t, lp) for row, t, lp in zip(state.rows, tokens, logprobs, strict=True))
            going_on = [i for i, row in enumerate(state.rows) if not row.finished]
            if not going_on:
                return None
            # Choices share the prompt: prefill once, then copy its cache rows.
            cache.batch_repeat_interleave(len(going_on))
            return [state.rows[i] for i in going_on], cache
        except Exception as exc:
            result.fail(state, exc)
            return None

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        # Qwen3 pads its embedding past the tokenizer's vocabulary; those ids are
        # no tokens (the engine could not decode them), so they are never offered.
        return logits[:, -1, : self.info.vocab_size].float()
