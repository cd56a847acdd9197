"""A request's sampling plan: its wire sampling params checked and resolved once, on arrival.

Everything the per-step code reads is settled here (greedy or not, the output limit, stop
ids, bias and allowed-id tensors on the model's device, the seed), so the hot path only
looks values up. The checks are those the hf backend needs beyond the engine's own
(`engine.generate`): it is driven directly too, and a bad id would index past the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.base import BackendInfo, BackendRequest, BackendRequestError
from engine.backends.checks import check_ids, logprobs_width, output_limit
from wire.protocol import SamplingParams

# vLLM's sampling epsilon: temperatures below it decode greedily.
GREEDY_BELOW = 1e-5
# vLLM raises smaller positive temperatures to this so logits / t stays finite.
MIN_TEMPERATURE = 1e-2
_SEED_SPACE = 2**64  # torch.Generator.manual_seed takes seeds modulo this


@dataclass(slots=True)
class Plan:
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
    logprobs: int | None  # top logprobs per token (-1 already resolved)
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


def _check_supported(sampling: SamplingParams) -> None:
    unsupported = {
        "prompt_logprobs": sampling.prompt_logprobs is not None,
        "bad_words": bool(sampling.bad_words),
    }
    named = [name for name, present in unsupported.items() if present]
    if named:
        raise BackendRequestError(f"the hf backend does not support {', '.join(named)}")


def make_plan(request: BackendRequest, info: BackendInfo, device: torch.device, eos: frozenset[int]) -> Plan:
    sampling = request.sampling
    _check_supported(sampling)
    vocab = info.vocab_size
    eos_ids = frozenset() if sampling.ignore_eos else eos
    stop_ids = frozenset(sampling.stop_token_ids or ())
    early = sorted(t for t in eos_ids | stop_ids if 0 <= t < vocab)
    bias_ids, bias_values = _bias(sampling.logit_bias, vocab, device)
    temperature = sampling.temperature
    return Plan(
        temperature=0.0 if temperature < GREEDY_BELOW else max(temperature, MIN_TEMPERATURE),
        top_k=sampling.top_k if 0 < sampling.top_k < vocab else 0,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        max_tokens=output_limit(sampling.max_tokens, len(request.prompt_token_ids), info.max_model_len),
        eos_ids=eos_ids,
        stop_ids=stop_ids,
        early_stop_ids=torch.tensor(early, device=device) if early and sampling.min_tokens else None,
        logprobs=logprobs_width(sampling.logprobs),
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
    check_ids(list(bias), vocab, "logit_bias")
    ids = torch.tensor(list(bias), dtype=torch.long, device=device)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32, device=device)


def _disallowed(allowed: list[int] | None, vocab: int, device: torch.device) -> torch.Tensor | None:
    if allowed is None:
        return None
    if not allowed:
        raise BackendRequestError("allowed_token_ids must not be empty")
    check_ids(allowed, vocab, "allowed_token_ids")
    mask = torch.ones(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(allowed, dtype=torch.long, device=device)] = False
    return mask


def generators(seed: int | None, n: int, device: torch.device) -> list[torch.Generator | None]:
    """One generator per choice, or torch's global RNG (None) when no seed was asked for."""
    if seed is None:
        return [None] * n
    # Choice i draws from seed + i, as vLLM seeds the children of an n>1 request.
    return [torch.Generator(device=device).manual_seed((seed + i) % _SEED_SPACE) for i in range(n)]
