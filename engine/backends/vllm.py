"""The `vllm` backend: generation on vLLM's v1 `AsyncLLM`, token ids in and out.

vLLM is imported lazily (in `start()` and the helpers it calls), so this
module imports without vLLM installed; only a process that starts the
backend needs it. onehop's engine owns text: vLLM runs with
`detokenize=False`, no stop strings and `output_kind=DELTA`, so each
`RequestOutput` carries only the new token ids (and their logprobs) of the
choices that advanced.

Mapping of vLLM's outputs (as its own `/inference/v1/generate` maps them, so
a onehop engine over this backend answers as a stock vLLM server does):

- logprobs: vLLM keeps, per position, the sampled token first and then the
  top-k by rank (a `FlatLogprobs`, which repeats the sampled token when it
  is also in the top-k; a `dict[int, Logprob]` de-duplicates it). The wire's
  `top_logprobs` is that order without the repeat, cut to `max(k, 1)`
  entries (all of them for `k == -1`); rank 0 (vLLM's mark for a NaN
  logprob) becomes no rank, and -inf/NaN logprobs become -9999.0.
- finish reasons: `stop`, `length` and `abort` pass through; `error` raises
  `BackendError`. `stop_reason` is vLLM's: the stop token id, or None for
  the primary EOS, length and abort (vLLM puts the generation config's
  other EOS ids among the stop tokens, so hitting one reports its id).
"""

from __future__ import annotations

import asyncio
import gc
import math
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from engine.backends.base import (
    BackendError,
    BackendInfo,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
    FinishReason,
    KVEventsAddress,
    PrefixCacheStats,
)
from derender.logprobs import LOGPROB_FLOOR
from wire.protocol import (
    CONSTRAINT_KINDS,
    GenerateLogProb,
    GenerateLogProbsContent,
    SamplingParams,
    StructuredOutputs,
)

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from derender.vocab import TokenVocab

BACKEND_NAME = "vllm"
# Bounded wait for the engine-core process to stop in close().
SHUTDOWN_TIMEOUT_S = 30.0
_FINISH_REASONS: frozenset[str] = frozenset(("stop", "length", "abort"))


class VLLMBackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What `AsyncEngineArgs` gets; `extra_engine_args` passes any other field by name."""

    model: str
    served_model_name: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool | None = None
    block_size: int | None = None
    kv_events: dict[str, Any] | None = None
    """vLLM's `--kv-events-config` (the engine's flag, passed through as `KVEventsConfig`)."""
    extra_engine_args: dict[str, Any] = {}

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for `AsyncEngineArgs`; unset fields keep vLLM's defaults."""
        args: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            # The engine server has its own metrics; vLLM's periodic stat log is noise.
            "disable_log_stats": True,
        }
        if self.served_model_name is not None:
            args["served_model_name"] = self.served_model_name
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.enable_prefix_caching is not None:
            args["enable_prefix_caching"] = self.enable_prefix_caching
        if self.block_size is not None:
            args["block_size"] = self.block_size
        if self.kv_events is not None:
            from vllm.config.kv_events import KVEventsConfig

            args["kv_events_config"] = KVEventsConfig(**self.kv_events)
        args.update(self.extra_engine_args)
        return args


class VLLMBackend:
    """The `Backend` protocol over one in-process `AsyncLLM`."""

    def __init__(self, config: VLLMBackendConfig) -> None:
        self._config = config
        self._llm: AsyncLLM | None = None
        self._info: BackendInfo | None = None
        self._running: set[str] = set()
        self._resets: set[asyncio.Task[bool]] = set()
        """Prefix-cache resets in flight (vLLM's is a coroutine; the route answers at once)."""

    @property
    def info(self) -> BackendInfo:
        if self._info is None:
            raise BackendError("the vllm backend is not started")
        return self._info

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is not None:
            return
        # Blocking (model load, engine-core process start): the server is not serving yet.
        # No local keeps the engine: vLLM's start-up retains this frame, and
        # close() must leave the engine unreferenced.
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._config.engine_args()))
        self._info = _backend_info(self._llm, self._config)

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._running:
            await llm.abort(list(self._running))
        llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        # Tracebacks of refused requests keep it in reference cycles; collect
        # them now, or its __del__ runs at interpreter exit and fails there.
        del llm
        gc.collect()

    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    # -- prefix caching (`PrefixCaching`): vLLM's own cache, metrics and events

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None  # vLLM's own `vllm:prefix_cache_*` metrics say it; the engine server adds none

    def kv_events_address(self) -> KVEventsAddress | None:
        """Where vLLM publishes the cache's events, as configured (vLLM binds a wildcard host)."""
        events = self._config.kv_events
        enabled = bool(events and events.get("enable_kv_cache_events"))
        if events is None or not enabled or (events.get("publisher") or "zmq") != "zmq":
            return None
        return KVEventsAddress(
            endpoint=events.get("endpoint", "tcp://*:5557"),
            replay_endpoint=events.get("replay_endpoint"),
            topic=events.get("topic", ""),
            block_size=self._config.block_size or 16,
        )

    def reset_prefix_cache(self) -> bool:
        """vLLM drops its cached blocks (and publishes `AllBlocksCleared` itself)."""
        llm = self._llm
        if llm is None:
            return False
        task = asyncio.get_running_loop().create_task(llm.reset_prefix_cache())
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)
        return True

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._running:
            await self._llm.abort(request_id)

    async def prepare(self, request: BackendRequest) -> BackendRequest:
        return request  # vLLM compiles grammars in its own engine-core process

    async def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        llm = self._started()
        rid = request.request_id
        params = vllm_sampling_params(request, self.info.eos_token_ids)
        prompt = await _render_prompt(llm, request.prompt_token_ids)
        top = _top_count(request.sampling.logprobs)
        # Cached tokens reach the answer's usage only when prefix caching was asked for: stock
        # vLLM writes `prompt_tokens_details` only when told to, and answers match it otherwise.
        cached = bool(self._config.enable_prefix_caching)
        self._running.add(rid)
        stream = llm.generate(prompt, params, rid, priority=request.priority)
        try:
            async for output in stream:
                batch = _outputs(output, top, cached)
                if batch:
                    yield batch
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer is gone (client, stop string, abort): stop vLLM first.
            await llm.abort(rid)
            raise
        except Exception as exc:
            raise _translate(exc) from exc
        finally:
            self._running.discard(rid)
            await stream.aclose()

    def bind_parsers(self, vocab: TokenVocab, reasoning: str | None, tool: str | None) -> None:
        """vLLM's own parsers for the names onehop lacks, bound into `vocab` (see `vllm_parsers`)."""
        from engine.backends.vllm_parsers import bind_vllm_parsers

        llm = self._started()
        bind_vllm_parsers(vocab, llm.tokenizer, reasoning, tool, model_config=llm.model_config)

    def _started(self) -> AsyncLLM:
        if self._llm is None:
            raise BackendError("the vllm backend is not started")
        return self._llm


# ------------------------------------------------------------ requests


def vllm_sampling_params(request: BackendRequest, engine_eos: frozenset[int] = frozenset()) -> Any:
    """onehop's wire `SamplingParams` → vLLM's, for token-only generation.

    EOS comes from vLLM's own view of the model (tokenizer and generation
    config); ids in `request.eos_token_ids` that vLLM does not know are
    added as stop tokens unless `ignore_eos`.
    """
    from vllm.exceptions import VLLMError
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    s = request.sampling
    _refuse_unsupported(s)
    stop_token_ids = list(s.stop_token_ids or ())
    if not s.ignore_eos:
        stop_token_ids += sorted(request.eos_token_ids - engine_eos - set(stop_token_ids))
    extra_args = dict(s.extra_args or {})
    if request.kv_transfer_params is not None:
        extra_args["kv_transfer_params"] = request.kv_transfer_params
    try:
        return VLLMSamplingParams(
            n=s.n,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            temperature=s.temperature,
            watermarking=s.watermarking,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop_token_ids=stop_token_ids,
            ignore_eos=s.ignore_eos,
            max_tokens=s.max_tokens,
            min_tokens=s.min_tokens,
            logprobs=s.logprobs,
            logprob_token_ids=s.logprob_token_ids,
            # Read flat below: no dict or Logprob object per candidate.
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            stream_interval=s.stream_interval,
            structured_outputs=_structured_outputs(s.structured_outputs),
            logit_bias=s.logit_bias,
            allowed_token_ids=s.allowed_token_ids,
            extra_args=extra_args or None,
            bad_words=s.bad_words,
            skip_reading_prefix_cache=s.skip_reading_prefix_cache,
            thinking_token_budget=s.thinking_token_budget,
            routed_experts_prompt_start=s.routed_experts_prompt_start,
            trace_decode_token_ids=s.trace_decode_token_ids,
        )
    except (VLLMError, ValueError, TypeError) as exc:
        raise BackendRequestError(str(exc)) from exc


def _refuse_unsupported(s: SamplingParams) -> None:
    # BackendOutput has no place for prompt logprobs, and FinishReason no
    # "repetition": refused rather than silently dropped.
    if s.prompt_logprobs is not None or s.prompt_logprob_token_ids is not None:
        raise BackendRequestError("prompt_logprobs are not supported by the vllm backend")
    if s.repetition_detection is not None:
        raise BackendRequestError("repetition_detection is not supported by the vllm backend")


def _structured_outputs(constraint: StructuredOutputs | None) -> Any:
    """onehop's decoded copy → vLLM's own params (its processor picks the grammar backend)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    fields = {
        f: getattr(constraint, f) for f in constraint.__struct_fields__ if f not in ("backend", "backend_was_auto")
    }
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as exc:
        raise BackendRequestError(f"invalid structured_outputs: {exc}") from exc


async def _render_prompt(llm: AsyncLLM, token_ids: Sequence[int]) -> Any:
    """Token ids → vLLM's engine input (the renderer checks length and vocabulary)."""
    from vllm.exceptions import VLLMError
    from vllm.inputs import TokensPrompt

    try:
        (engine_input,) = await llm.renderer.render_cmpl_async(
            [TokensPrompt(prompt_token_ids=list(token_ids))]
        )
    except (VLLMError, ValueError, TypeError) as exc:
        raise BackendRequestError(str(exc)) from exc
    return engine_input


def _translate(exc: Exception) -> Exception:
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, (BackendError, BackendRequestError)):
        return exc
    if isinstance(exc, (VLLMClientError, ValueError)):
        return BackendRequestError(str(exc))
    return BackendError(f"vLLM failed: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------ outputs (per step: hot path)


def _outputs(output: Any, top: int | None, report_cached: bool) -> list[BackendOutput]:
    """One `RequestOutput` (DELTA) → the choices that advanced or finished."""
    cached = output.num_cached_tokens if report_cached else None
    batch: list[BackendOutput] = []
    for completion in output.outputs:
        ids = list(completion.token_ids)
        reason = completion.finish_reason
        if not ids and reason is None:
            continue
        batch.append(
            BackendOutput(
                index=completion.index,
                token_ids=ids,
                logprobs=None if top is None else logprob_entries(completion.logprobs, ids, top),
                finish_reason=_finish_reason(reason),
                stop_reason=completion.stop_reason if isinstance(completion.stop_reason, int) else None,
                num_cached_tokens=cached,
                kv_transfer_params=getattr(output, "kv_transfer_params", None) if reason is not None else None,
            )
        )
    return batch


def _finish_reason(reason: str | None) -> FinishReason | None:
    if reason is None or reason in _FINISH_REASONS:
        return reason  # type: ignore[return-value]
    raise BackendError(f"vLLM ended a choice with finish_reason={reason!r}")


def _top_count(logprobs: int | None) -> int | None:
    """How many `top_logprobs` entries the wire carries: None for no logprobs, -1 for all."""
    if logprobs is None:
        return None
    return -1 if logprobs == -1 else max(logprobs, 1)


def logprob_entries(logprobs: Any, token_ids: Sequence[int], top: int) -> list[GenerateLogProbsContent]:
    """vLLM's per-position logprobs (flat or dicts) → one wire entry per token."""
    if logprobs is None:
        return [GenerateLogProbsContent(token_id=t, logprob=LOGPROB_FLOOR) for t in token_ids]
    if hasattr(logprobs, "start_indices"):
        return _flat_entries(logprobs, token_ids, top)
    return [_dict_entry(position, t, top) for position, t in zip(logprobs, token_ids, strict=True)]


def _flat_entries(flat: Any, token_ids: Sequence[int], top: int) -> list[GenerateLogProbsContent]:
    ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    entries: list[GenerateLogProbsContent] = []
    for start, end, sampled in zip(flat.start_indices, flat.end_indices, token_ids, strict=True):
        if start == end or ids[start] != sampled:
            entries.append(GenerateLogProbsContent(token_id=sampled, logprob=LOGPROB_FLOOR))
            continue
        # The sampled token leads; it may appear again among the top-k (same values).
        keep = [start, *(i for i in range(start + 1, end) if ids[i] != sampled)]
        if top != -1:
            keep = keep[:top]
        entries.append(
            GenerateLogProbsContent(
                token_id=sampled,
                logprob=_clamp(values[start]),
                rank=ranks[start] or None,
                top_logprobs=[
                    GenerateLogProb(token_id=ids[i], logprob=_clamp(values[i]), rank=ranks[i] or None)
                    for i in keep
                ],
            )
        )
    return entries


def _dict_entry(position: dict[int, Any] | None, sampled: int, top: int) -> GenerateLogProbsContent:
    chosen = position.get(sampled) if position else None
    if position is None or chosen is None:
        return GenerateLogProbsContent(token_id=sampled, logprob=LOGPROB_FLOOR)
    items = list(position.items())
    if top != -1:
        items = items[:top]
    return GenerateLogProbsContent(
        token_id=sampled,
        logprob=_clamp(chosen.logprob),
        rank=chosen.rank or None,
        top_logprobs=[
            GenerateLogProb(token_id=t, logprob=_clamp(lp.logprob), rank=lp.rank or None) for t, lp in items
        ],
    )


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


# ------------------------------------------------------------ model facts


def _backend_info(llm: AsyncLLM, config: VLLMBackendConfig) -> BackendInfo:
    model_config = llm.model_config
    tokenizer = llm.tokenizer
    # vLLM accepts ids up to the larger of the tokenizer's (added tokens
    # included) and the model's vocabulary: Qwen3 pads its embeddings past
    # the tokenizer, multimodal models add placeholder ids past the embeddings.
    vocab_size = model_config.get_vocab_size()
    if tokenizer is not None:
        vocab_size = max(vocab_size, tokenizer.max_token_id + 1)
    return BackendInfo(
        name=BACKEND_NAME,
        model=config.served_model_name or model_config.served_model_name or config.model,
        max_model_len=model_config.max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=_eos_token_ids(llm),
        constraints=frozenset(CONSTRAINT_KINDS),  # vLLM's structured-output manager enforces them all
    )


def _eos_token_ids(llm: AsyncLLM) -> frozenset[int]:
    """The tokenizer's EOS plus the generation config's: what vLLM stops on."""
    ids: set[int] = set()
    tokenizer = llm.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    configured = llm.model_config.try_get_generation_config().get("eos_token_id")
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return frozenset(ids)
