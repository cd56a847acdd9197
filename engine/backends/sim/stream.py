"""One choice's token stream: its planned ids, then padding, under the request's stop rules.

The rules are vLLM scheduler's, applied to each token in order: an EOS id ends the choice
(``stop``), then a stop id (``stop`` with it as ``stop_reason``), then the limit
(``length``); EOS and stop ids are skipped until ``min_tokens``. Logprobs are synthetic
but well formed, and depend only on the token and its position.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.backends.base import BackendInfo, BackendOutput, BackendRequest, FinishReason
from engine.backends.checks import logprobs_width, output_limit, request_eos
from wire.protocol import GenerateLogProb, GenerateLogProbsContent

_RANK_STEP = 1.5


@dataclass(frozen=True, slots=True)
class Rules:
    """The token-level stop conditions of one request."""

    eos: frozenset[int]
    emitted_eos: int | None
    stops: frozenset[int]
    min_tokens: int
    limit: int
    logprobs: int | None


def rules_for(request: BackendRequest, info: BackendInfo, eos_preference: Sequence[int]) -> Rules:
    """The request's stop rules; the EOS emitted is the first of `eos_preference` it allows, else its smallest."""
    sampling = request.sampling
    eos = request_eos(request, info)
    preferred = next((i for i in eos_preference if i in eos), min(eos, default=None))
    return Rules(
        eos=frozenset() if sampling.ignore_eos else eos,
        emitted_eos=None if sampling.ignore_eos else preferred,
        stops=frozenset(sampling.stop_token_ids or ()),
        min_tokens=sampling.min_tokens,
        limit=output_limit(sampling.max_tokens, len(request.prompt_token_ids), info.max_model_len),
        logprobs=logprobs_width(sampling.logprobs),
    )


class Choice:
    """One choice: its planned ids, then padding, under the request's stop rules."""

    __slots__ = ("_count", "_logprobs", "_rules", "_source", "_started", "finished", "index")

    def __init__(self, index: int, plan: list[int], padding: Iterator[int], rules: Rules, logprobs: Logprobs) -> None:
        self.index = index
        self.finished = False
        self._rules = rules
        self._count = 0
        self._logprobs = logprobs
        self._started = False
        if rules.emitted_eos is None:
            self._source: Iterator[int] = itertools.chain(plan, padding)
        else:
            self._source = itertools.chain(plan, self._pad_to_min(padding), (rules.emitted_eos,))

    def _pad_to_min(self, padding: Iterator[int]) -> Iterator[int]:
        # Lazy: masked ids in the plan leave the count short, so read it only now.
        while self._count < self._rules.min_tokens:
            yield next(padding)

    def take(self, width: int) -> BackendOutput:
        """The next step: up to `width` tokens, with a finish reason when the choice ends.

        Hot path (per token): set lookups only; ids were encoded before the first step.
        """
        rules = self._rules
        ids: list[int] = []
        finish: FinishReason | None = None
        stop_reason: int | None = None
        start = self._count
        for token in self._source:
            masked = token in rules.eos or token in rules.stops
            if masked and self._count < rules.min_tokens:
                continue  # vLLM masks EOS and stop ids until min_tokens
            ids.append(token)
            self._count += 1
            if token in rules.eos:
                finish = "stop"
            elif token in rules.stops:
                finish, stop_reason = "stop", token
            elif self._count >= rules.limit:
                finish = "length"
            if finish is not None or len(ids) == width:
                break
        else:
            finish = "length"  # unreachable: the source ends only in an EOS, which stops above
        self.finished = finish is not None
        output = BackendOutput(index=self.index, token_ids=ids, finish_reason=finish, stop_reason=stop_reason)
        if rules.logprobs is not None:
            output.logprobs = [self._logprobs.entry(t, start + i) for i, t in enumerate(ids)]
        if not self._started:
            output.queued_s = 0.0  # no batch limit; the backend puts the prefill lane's wait here
            self._started = True
        return output

    def aborted(self) -> BackendOutput:
        logprobs: list[GenerateLogProbsContent] | None = [] if self._rules.logprobs is not None else None
        self.finished = True
        return BackendOutput(index=self.index, token_ids=[], logprobs=logprobs, finish_reason="abort")


class Logprobs:
    """Synthetic logprobs: the sampled id ranks first, k distinct other ids follow."""

    __slots__ = ("_k", "_stride", "_vocab_size")

    def __init__(self, k: int, vocab_size: int) -> None:
        self._k = min(k, vocab_size - 1)
        self._vocab_size = vocab_size
        # A stride coprime with the vocabulary size visits k distinct ids before repeating.
        stride = 7919
        while math.gcd(stride, vocab_size) != 1:
            stride += 1
        self._stride = stride

    def entry(self, token: int, position: int) -> GenerateLogProbsContent:
        logprob = -0.05 - ((token * 31 + position * 17) % 101) / 200
        top = [GenerateLogProb(token_id=token, logprob=logprob, rank=1)]
        for rank in range(2, self._k + 2):
            other = (token + (rank - 1) * self._stride) % self._vocab_size
            top.append(GenerateLogProb(token_id=other, logprob=logprob - _RANK_STEP * (rank - 1), rank=rank))
        return GenerateLogProbsContent(token_id=token, logprob=logprob, rank=1, top_logprobs=top)
