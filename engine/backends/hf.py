"""The transformers backend: real generation with continuous batching on one KV cache.

A request moves through three states, all changed on the event loop:

    waiting   registered by generate(), not yet prefilled
    running   its rows (one per choice) sit in the batch, one token per decode step
    released  finished, aborted, closed by its consumer or failed; nothing more
              is generated and running() no longer lists it

Each scheduler iteration is one step boundary. Rows whose request went away
are dropped, then one decode forward pass advances every row in the batch by
one token, then the waiting requests that fit are prefilled (each alone) and
join. The batch shares one ``DynamicCache`` whose rows are left-padded to a
common length: a 2D attention mask hides each row's padding and explicit
``position_ids`` keep each row's rotary positions its own. Keys are cached
after rotary, so padding a row on the left never changes what it computed.
Rows that leave are dropped with ``batch_select_indices`` and padding columns
no row needs any more are cut from the left; prompts are never re-run.

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
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec
import torch
from msgspec import Meta
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
)
from transformers.cache_utils import DynamicLayer

from engine.backends.base import (
    BackendError,
    BackendInfo,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
    FinishReason,
)
from engine.backends.grammar import ChoiceGrammar, GrammarTokenizer
from engine.backends.grammar_check import DEFAULT_TIMEOUT_S, GrammarCheck, compile_executor
from engine.grammar_compile import CONSTRAINTS, GrammarError, compile_grammar
from engine.protocol import GenerateLogProb, GenerateLogProbsContent, SamplingParams, StructuredOutputs

__all__ = ["HFBackend", "HFBackendConfig"]

logger = logging.getLogger(__name__)

# vLLM's sampling epsilon: temperatures below it decode greedily.
GREEDY_BELOW = 1e-5
# vLLM raises smaller positive temperatures to this so logits / t stays finite.
MIN_TEMPERATURE = 1e-2
# logprobs=-1 asks for the whole vocabulary (151k entries a token for Qwen3);
# no client reads that, so it is capped at OpenAI's top_logprobs ceiling.
ALL_LOGPROBS_CAP = 20
# top_p first looks for its nucleus among this many best tokens: real models
# rarely spread 0.9 of their mass wider, and a full sort is the slow path.
TOP_P_POOL = 1024
_SEED_SPACE = 2**64  # torch.Generator.manual_seed takes seeds modulo this

_T = TypeVar("_T")


class HFBackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    """A local Hugging Face causal-LM folder."""
    served_model_name: str | None = None
    """Default: the folder's name."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: float32 on CPU, bfloat16 on CUDA."""
    max_batch_size: Annotated[int, Meta(ge=1)] = 16
    """Rows (choices) decoded together; a request with n choices takes n rows."""
    max_model_len: Annotated[int, Meta(ge=1)] | None = None
    """Default: the model config's max_position_embeddings."""
    threads: Annotated[int, Meta(ge=1)] | None = None
    """torch intra-op threads when set."""
    grammar_timeout_s: Annotated[float, Meta(gt=0)] = DEFAULT_TIMEOUT_S
    """Longest a structured-output constraint may take to compile (in the check process):
    past it the request is a 400 (a 60,000-symbol grammar took 3 s on this project's CPUs)."""


# ------------------------------------------------------------ model folder


def read_info(config: HFBackendConfig) -> BackendInfo:
    """The served name, limits, vocabulary size and EOS ids of a model folder (reads files only)."""
    folder = Path(config.model)
    if not folder.is_dir():
        raise BackendError(f"the model folder {folder} does not exist")
    try:
        text_config = AutoConfig.from_pretrained(folder, local_files_only=True).get_text_config()
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read the model config in {folder}: {exc}") from exc
    tokenizer = _load_tokenizer(folder)
    # Ids past the embedding would crash the forward, whatever the tokenizer knows.
    vocab = min(len(tokenizer), text_config.vocab_size) if tokenizer is not None else text_config.vocab_size
    eos = _generation_eos(folder)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if not eos:
        eos = _as_ids(getattr(text_config, "eos_token_id", None))
    return BackendInfo(
        name="hf",
        model=config.served_model_name or folder.name,
        max_model_len=config.max_model_len or text_config.max_position_embeddings,
        vocab_size=vocab,
        eos_token_ids=frozenset(eos),
        constraints=CONSTRAINTS if tokenizer is not None else frozenset(),  # a grammar needs the token strings
    )


def _load_tokenizer(folder: Path) -> Any:
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _generation_eos(folder: Path) -> set[int]:
    if not (folder / "generation_config.json").is_file():
        return set()
    return _as_ids(GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id)


def _as_ids(value: int | Sequence[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _pick_device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        raise BackendError("device='cuda' was asked for but torch sees no CUDA device")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _pick_dtype(wanted: str, device: torch.device) -> torch.dtype:
    if wanted == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[wanted]


def load_model(config: HFBackendConfig) -> tuple[Any, torch.device]:
    """Load the model for inference; blocking, so call it off the event loop."""
    device = _pick_device(config.device)
    dtype = _pick_dtype(config.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to() in a decorator mypy misreads
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves its eval() unannotated
    layers = DynamicCache(config=model.config).layers
    # Joins pad and concatenate whole key/value tensors; sliding-window and
    # linear-attention layers keep other state that this cannot line up.
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise BackendError("the hf backend needs a model with full attention in every layer")
    return model, device


# ------------------------------------------------------------ request state


@dataclass(slots=True)
class _Plan:
    """One request's sampling settings, resolved and checked once when it arrives."""

    temperature: float  # 0.0: greedy
    top_k: int  # 0: off
    top_p: float
    min_p: float
    min_tokens: int
    max_tokens: int  # already capped by max_model_len - prompt length
    eos_ids: frozenset[int]  # empty with ignore_eos
    stop_ids: frozenset[int]
    early_stop_ids: torch.Tensor | None  # masked until min_tokens
    logprobs: int | None
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    disallowed: torch.Tensor | None  # bool [vocab]: not in allowed_token_ids
    seed: int | None
    always_shapes: bool = False  # allowed ids, a bias or a penalty changes the logits every step

    def __post_init__(self) -> None:
        self.always_shapes = (
            self.bias_ids is not None
            or self.disallowed is not None
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def shapes(self, row: _Row) -> bool:
        """Whether the logits of this row need changing before sampling."""
        return (
            self.always_shapes
            or (self.early_stop_ids is not None and len(row.output_ids) < self.min_tokens)
            or (row.grammar is not None and row.grammar.active)
        )


class _Outbox:
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
class _Request:
    request: BackendRequest
    plan: _Plan
    prompt: torch.Tensor  # [1, prompt length] on the model's device
    outbox: _Outbox = field(default_factory=_Outbox)
    rows: list[_Row] = field(default_factory=list)
    gone: bool = False  # aborted, closed by its consumer, or the backend is closing
    released: asyncio.Event = field(default_factory=asyncio.Event)
    registered: float = field(default_factory=time.monotonic)
    queued_s: float | None = None  # set when it joins the batch


@dataclass(slots=True, eq=False)
class _Row:
    """One choice of a request: one row of the batch."""

    owner: _Request
    index: int
    generator: torch.Generator | None  # None: torch's global RNG (no seed asked for)
    output_ids: list[int] = field(default_factory=list)
    grammar: ChoiceGrammar | None = None  # structured outputs (made by `HFBackend.prepare`)
    finished: bool = False  # no more tokens to sample (set on the worker thread)
    reported: bool = False  # its finish_reason reached the consumer's outbox (set on the event loop)

    def next_position(self) -> int:
        """The position of this row's last sampled token, which the next decode step feeds."""
        return self.owner.prompt.shape[1] + len(self.output_ids) - 1


@dataclass(slots=True)
class _Emitted:
    row: _Row
    token: int
    logprobs: GenerateLogProbsContent | None
    finish_reason: FinishReason | None
    stop_reason: int | None


@dataclass(slots=True)
class _StepResult:
    emitted: list[_Emitted] = field(default_factory=list)
    failed: dict[int, tuple[_Request, Exception]] = field(default_factory=dict)  # by id(request)

    def fail(self, request: _Request, error: Exception) -> None:
        self.failed.setdefault(id(request), (request, error))


def _accept(row: _Row, token: int, logprobs: GenerateLogProbsContent | None) -> _Emitted:
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
    return _Emitted(row, token, logprobs, finish, stop)


# ------------------------------------------------------------ the batched cache


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class _Batch:
    """The running rows and their shared, left-padded KV cache; used only on the worker thread."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # long [rows, cached columns], 0 on padding

    def clear(self) -> None:
        self.rows, self.cache, self.mask = [], None, None

    def retain(self, keep: list[int]) -> None:
        """Keep only the rows at these batch positions, in order."""
        if len(keep) == len(self.rows):
            return
        if not keep or self.cache is None or self.mask is None:
            self.clear()
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.rows = [self.rows[i] for i in keep]
        self._trim_left()

    def _trim_left(self) -> None:
        # A long request that left may have forced padding on every other row.
        assert self.cache is not None and self.mask is not None
        lead = int(self.mask.any(dim=0).int().argmax())
        if lead == 0:
            return
        for layer in _layers(self.cache):
            keys, values = _keys_values(layer)
            layer.keys, layer.values = keys[:, :, lead:], values[:, :, lead:]
        self.mask = self.mask[:, lead:]

    def join(self, pieces: list[tuple[list[_Row], DynamicCache]]) -> None:
        """Add prefilled rows, padding every cache on the left to the longest one."""
        if not pieces:
            return
        caches = ([self.cache] if self.cache is not None else []) + [cache for _, cache in pieces]
        masks = [self.mask] if self.mask is not None else []
        for rows, cache in pieces:
            masks.append(torch.ones(len(rows), cache.get_seq_length(), dtype=torch.long, device=_device_of(cache)))
        width = max(mask.shape[1] for mask in masks)
        base = caches[0]
        for depth, layer in enumerate(_layers(base)):
            parts = [_keys_values(_layers(cache)[depth]) for cache in caches]
            layer.keys = torch.cat([_pad_left(keys, width, 2) for keys, _ in parts])
            layer.values = torch.cat([_pad_left(values, width, 2) for _, values in parts])
        self.cache = base
        self.mask = torch.cat([_pad_left(mask, width, 1) for mask in masks])
        for rows, _ in pieces:
            self.rows.extend(rows)

    def decode_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, position_ids and a 4D additive attention mask for one decode step.

        One query per row sees every column it owns, so the padding mask is the
        whole mask. It is handed over prepared because transformers would build
        a boolean one, and torch 2.13's CPU SDPA takes ~2.6 ms on a broadcast
        boolean mask where an additive float one takes ~7 us (q=2, kv=100).
        """
        assert self.mask is not None
        device = self.mask.device
        ids = torch.tensor([[row.output_ids[-1]] for row in self.rows], device=device)
        positions = torch.tensor([[row.next_position()] for row in self.rows], device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        hidden = (self.mask == 0)[:, None, None, :]
        additive = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)
        return ids, positions, additive


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    # load_model checked that every layer of this model's cache is a plain DynamicLayer.
    return cast(list[DynamicLayer], cache.layers)


def _keys_values(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    return cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)


def _device_of(cache: DynamicCache) -> torch.device:
    return _keys_values(_layers(cache)[0])[0].device


# ------------------------------------------------------------ sampling (hot path: once per step)


def _shape_logits(logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
    """Allowed ids, min_tokens, logit_bias, then penalties, in vLLM's order; copies only if needed."""
    shaped = [i for i, row in enumerate(rows) if row.owner.plan.shapes(row)]
    if not shaped:
        return logits
    # contiguous: prefill hands n choices one expanded (shared) row
    logits = logits.clone(memory_format=torch.contiguous_format)
    for i in shaped:
        row = rows[i]
        plan = row.owner.plan
        values = logits[i]
        if plan.disallowed is not None:
            values.masked_fill_(plan.disallowed, -math.inf)
        if plan.early_stop_ids is not None and len(row.output_ids) < plan.min_tokens:
            values[plan.early_stop_ids] = -math.inf
        if plan.bias_ids is not None and plan.bias_values is not None:
            values.index_add_(0, plan.bias_ids, plan.bias_values)
        _penalize(values, row)
        if row.grammar is not None and row.grammar.active:
            row.grammar.mask(values)  # last: nothing after it may revive a refused token
    return logits


def _penalize(values: torch.Tensor, row: _Row) -> None:
    plan = row.owner.plan
    if plan.repetition_penalty == 1.0 and not (plan.frequency_penalty or plan.presence_penalty):
        return
    out = torch.tensor(row.output_ids, dtype=torch.long, device=values.device)
    if plan.repetition_penalty != 1.0:
        # vLLM's repetition penalty covers prompt and output tokens alike.
        seen = torch.zeros_like(values, dtype=torch.bool)
        seen[row.owner.prompt[0]] = True
        seen[out] = True
        hit = values[seen]
        values[seen] = torch.where(hit > 0, hit / plan.repetition_penalty, hit * plan.repetition_penalty)
    if (plan.frequency_penalty or plan.presence_penalty) and len(out):
        counts = torch.bincount(out, minlength=values.shape[0]).to(values.dtype)
        values -= plan.frequency_penalty * counts + plan.presence_penalty * (counts > 0).to(values.dtype)


def _min_p(logits: torch.Tensor, plans: Sequence[_Plan]) -> torch.Tensor:
    if not any(plan.min_p > 0 for plan in plans):
        return logits
    probs = logits.softmax(dim=-1)
    floor = torch.tensor([plan.min_p for plan in plans], device=logits.device)
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * floor[:, None], -math.inf)


def _choose(logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
    """Greedy argmax, or a draw from each row's own generator after temperature, min_p, top_k, top_p."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.owner.plan.temperature > 0]
    if not sampled:
        return tokens
    plans = [rows[i].owner.plan for i in sampled]
    generators = [rows[i].generator for i in sampled]
    temperature = torch.tensor([plan.temperature for plan in plans], device=logits.device)
    scaled = _min_p(logits[sampled] / temperature[:, None], plans)
    narrow = [j for j, plan in enumerate(plans) if plan.top_k or plan.top_p < 1.0]
    wide = [j for j, plan in enumerate(plans) if not (plan.top_k or plan.top_p < 1.0)]
    picked = torch.empty(len(sampled), dtype=torch.long, device=logits.device)
    if wide:
        picked[wide] = _race(scaled[wide], [generators[j] for j in wide])
    if narrow:
        picked[narrow] = _race_in_pool(scaled[narrow], [plans[j] for j in narrow], [generators[j] for j in narrow])
    tokens[sampled] = picked
    return tokens


def _race(
    logits: torch.Tensor, generators: Sequence[torch.Generator | None], widths: Sequence[int] | None = None
) -> torch.Tensor:
    """argmax p / E with E ~ Exp(1) per candidate is a draw from p (vLLM samples the same way).

    Each row draws noise for its own candidates only, so a seeded row consumes
    its generator the same way whatever shares the batch. -log(U) is an Exp(1)
    draw ~8x cheaper on CPU than Tensor.exponential_ (0.3 vs 2.4 ms over 151k).
    """
    probs = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # the scale cancels in the argmax
    noise = torch.full_like(probs, math.inf)
    for j, generator in enumerate(generators):
        width = probs.shape[1] if widths is None else widths[j]
        noise[j, :width] = -torch.rand(width, generator=generator, device=probs.device).log()
    return (probs / noise).argmax(dim=-1)


def _race_in_pool(
    logits: torch.Tensor, plans: Sequence[_Plan], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """top_k, then top_p renormalised over what top_k kept (vLLM's order), among the best candidates only.

    A full sort costs ~10 ms a row over Qwen3's vocabulary on CPU; top_k needs
    only its k best, and top_p first looks for its nucleus among the
    TOP_P_POOL best, sorting everything only when the mass there falls short.
    """
    vocab, device = logits.shape[1], logits.device
    widths = [plan.top_k or min(TOP_P_POOL, vocab) for plan in plans]
    values, ids = logits.topk(max(widths), dim=-1)
    nucleus_only = [j for j, plan in enumerate(plans) if not plan.top_k]
    if nucleus_only:
        pooled = values[nucleus_only, : min(TOP_P_POOL, vocab)].logsumexp(dim=-1)
        mass = (pooled - logits[nucleus_only].logsumexp(dim=-1)).exp().tolist()
        wider = [j for j, held in zip(nucleus_only, mass, strict=True) if held < plans[j].top_p]
        if wider:
            for j in wider:
                widths[j] = vocab
            values, ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(values.shape[1], device=device)
    values = values.masked_fill(ranks[None, :] >= torch.tensor(widths, device=device)[:, None], -math.inf)
    if any(plan.top_p < 1.0 for plan in plans):
        probs = (values - values.logsumexp(dim=-1, keepdim=True)).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows without top_p get an unreachable bound, so rounding never drops their tail.
        p = torch.tensor([plan.top_p if plan.top_p < 1.0 else math.inf for plan in plans], device=device)
        values = values.masked_fill(mass_before >= p[:, None], -math.inf)
    return ids.gather(1, _race(values, generators, widths)[:, None]).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[_Row]) -> list[GenerateLogProbsContent | None]:
    """Raw-logit logprobs (vLLM's default raw_logprobs mode): sampled token first, then top-k by rank."""
    entries: list[GenerateLogProbsContent | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.owner.plan.logprobs is not None]
    if not wanted:
        return entries
    counts = [_top_count(rows[i].owner.plan.logprobs) for i in wanted]
    logprobs = raw[wanted].log_softmax(dim=-1)
    picked = tokens[wanted]
    chosen = logprobs.gather(1, picked[:, None])
    # vLLM's rank: how many tokens are at least as likely, so the best is 1.
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    top_values, top_ids = logprobs.topk(max(counts), dim=-1)
    rows_ids, rows_values = top_ids.tolist(), top_values.tolist()
    picked_ids, chosen_values = picked.tolist(), chosen[:, 0].tolist()
    for j, i in enumerate(wanted):
        k = counts[j]
        entries[i] = _entry(picked_ids[j], chosen_values[j], ranks[j], rows_ids[j][:k], rows_values[j][:k])
    return entries


def _top_count(logprobs: int | None) -> int:
    assert logprobs is not None
    return ALL_LOGPROBS_CAP if logprobs < 0 else logprobs


def _entry(token: int, value: float, rank: int, top_ids: list[int], top_values: list[float]) -> GenerateLogProbsContent:
    # vLLM keeps a position's logprobs in a dict keyed by token id, so a sampled
    # token that is also a top-k candidate is listed once, in first place.
    top = [GenerateLogProb(token_id=token, logprob=value, rank=rank)]
    top += [
        GenerateLogProb(token_id=t, logprob=v, rank=place)
        for place, (t, v) in enumerate(zip(top_ids, top_values, strict=True), start=1)
        if t != token
    ]
    return GenerateLogProbsContent(token_id=token, logprob=value, rank=rank, top_logprobs=top)


def _sample(logits: torch.Tensor, rows: Sequence[_Row]) -> tuple[list[int], list[GenerateLogProbsContent | None]]:
    """One token per row from float32 logits [rows, vocab], with logprobs where asked."""
    tokens = _choose(_shape_logits(logits, rows), rows)
    return tokens.tolist(), _logprobs(logits, tokens, rows)


# ------------------------------------------------------------ request checks


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BackendRequestError(f"token id {bad} in {what} is out of vocabulary (size {vocab})")


def _check_supported(sampling: SamplingParams) -> None:
    unsupported = {
        "prompt_logprobs": sampling.prompt_logprobs is not None,
        "bad_words": bool(sampling.bad_words),
    }
    named = [name for name, present in unsupported.items() if present]
    if named:
        raise BackendRequestError(f"the hf backend does not support {', '.join(named)}")


def _plan(request: BackendRequest, info: BackendInfo, device: torch.device, eos: frozenset[int]) -> _Plan:
    sampling = request.sampling
    _check_supported(sampling)
    vocab = info.vocab_size
    room = info.max_model_len - len(request.prompt_token_ids)
    eos_ids = frozenset() if sampling.ignore_eos else eos
    stop_ids = frozenset(sampling.stop_token_ids or ())
    early = sorted(t for t in eos_ids | stop_ids if 0 <= t < vocab)
    bias_ids, bias_values = _bias(sampling.logit_bias, vocab, device)
    temperature = sampling.temperature
    return _Plan(
        temperature=0.0 if temperature < GREEDY_BELOW else max(temperature, MIN_TEMPERATURE),
        top_k=sampling.top_k if 0 < sampling.top_k < vocab else 0,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        max_tokens=min(sampling.max_tokens, room) if sampling.max_tokens is not None else room,
        eos_ids=eos_ids,
        stop_ids=stop_ids,
        early_stop_ids=torch.tensor(early, device=device) if early and sampling.min_tokens else None,
        logprobs=sampling.logprobs,
        repetition_penalty=sampling.repetition_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        bias_ids=bias_ids,
        bias_values=bias_values,
        disallowed=_disallowed(sampling.allowed_token_ids, vocab, device),
        seed=None if sampling.seed == -1 else sampling.seed,  # vLLM reads -1 as "no seed"
    )


def _bias(
    bias: dict[int, float] | None, vocab: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not bias:
        return None, None
    _check_ids(list(bias), vocab, "logit_bias")
    ids = torch.tensor(list(bias), dtype=torch.long, device=device)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32, device=device)


def _disallowed(allowed: list[int] | None, vocab: int, device: torch.device) -> torch.Tensor | None:
    if allowed is None:
        return None
    if not allowed:
        raise BackendRequestError("allowed_token_ids must not be empty")
    _check_ids(allowed, vocab, "allowed_token_ids")
    mask = torch.ones(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(allowed, dtype=torch.long, device=device)] = False
    return mask


def _generators(seed: int | None, n: int, device: torch.device) -> list[torch.Generator | None]:
    if seed is None:
        return [None] * n
    # Choice i draws from seed + i, as vLLM seeds the children of an n>1 request.
    return [torch.Generator(device=device).manual_seed((seed + i) % _SEED_SPACE) for i in range(n)]


# ------------------------------------------------------------ the backend


class HFBackend:
    """A `Backend` running a transformers causal LM with continuous batching."""

    def __init__(self, config: HFBackendConfig) -> None:
        self._config = config
        self._info: BackendInfo | None = None
        self._model: Any = None
        self._device = torch.device("cpu")
        self._executor: ThreadPoolExecutor | None = None
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._batch = _Batch()
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
                tokenizer = await self._in_thread(_load_tokenizer, Path(self._config.model))
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
        self._batch = _Batch()
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

    def _register(self, request: BackendRequest) -> _Request:
        if self._task is None or self._task.done() or self._closing:
            raise BackendError("the hf backend is not running")
        if request.request_id in self._requests:
            raise BackendRequestError(f"request id {request.request_id!r} is already running")
        info = self.info
        ids = request.prompt_token_ids
        if not ids:
            raise BackendRequestError("the prompt must hold at least one token")
        if len(ids) > info.max_model_len:
            raise BackendRequestError(
                f"the prompt ({len(ids)} tokens) is longer than the maximum model length of {info.max_model_len}"
            )
        _check_ids(ids, info.vocab_size, "the prompt")
        n = request.sampling.n
        if n > self._config.max_batch_size:
            raise BackendRequestError(f"n={n} is more than max_batch_size={self._config.max_batch_size}")
        plan = _plan(request, info, self._device, request.eos_token_ids or info.eos_token_ids)
        prompt = torch.tensor([list(ids)], dtype=torch.long, device=self._device)
        state = _Request(request, plan, prompt)
        state.rows = [_Row(state, i, g) for i, g in enumerate(_generators(plan.seed, n, self._device))]
        if isinstance(request.prepared, list):
            for row, matcher in zip(state.rows, request.prepared, strict=True):
                row.grammar = matcher
        self._requests[request.request_id] = state
        self._waiting.append(state)
        self._wake.set()
        return state

    def _abandon(self, state: _Request) -> None:
        if state.released.is_set():
            return
        state.gone = True
        if state in self._waiting:
            self._waiting.remove(state)
            self._release(state)
        else:
            self._wake.set()

    def _release(self, state: _Request) -> None:
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

    def _fail(self, state: _Request, error: BackendError) -> None:
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

    def _admit(self, running: int) -> list[_Request]:
        room = self._config.max_batch_size - running
        joining: list[_Request] = []
        # First come, first served: a wide n>1 request at the head is not overtaken.
        while self._waiting and len(self._waiting[0].rows) <= room:
            state = self._waiting.popleft()
            state.queued_s = time.monotonic() - state.registered
            joining.append(state)
            room -= len(state.rows)
        return joining

    def _deliver(self, result: _StepResult) -> None:
        touched: dict[int, _Request] = {}
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

    def _work(self, keep: list[int], joining: list[_Request]) -> _StepResult:
        result = _StepResult()
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

    def _decode(self, result: _StepResult) -> None:
        batch = self._batch
        try:
            ids, positions, mask = batch.decode_inputs(self._model.dtype)
            out = self._model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=batch.cache, use_cache=True
            )
            tokens, logprobs = _sample(self._logits(out.logits), batch.rows)
        except Exception as exc:
            # The cache may be half updated: drop the whole batch.
            self._fail_batch(result, exc, [row.owner for row in batch.rows])
            return
        result.emitted.extend(_accept(row, t, lp) for row, t, lp in zip(batch.rows, tokens, logprobs, strict=True))

    def _fail_batch(self, result: _StepResult, error: Exception, owners: list[_Request]) -> None:
        for owner in owners + [row.owner for row in self._batch.rows]:
            result.fail(owner, error)
        self._batch.clear()

    def _prefill(self, state: _Request, result: _StepResult) -> tuple[list[_Row], DynamicCache] | None:
        """Run one prompt alone, sample each choice's first token; the rows that go on, with their cache."""
        try:
            cache = DynamicCache(config=self._model.config)
            out = self._model(input_ids=state.prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = self._logits(out.logits).expand(len(state.rows), -1)
            tokens, logprobs = _sample(logits, state.rows)
            result.emitted.extend(_accept(row, t, lp) for row, t, lp in zip(state.rows, tokens, logprobs, strict=True))
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
