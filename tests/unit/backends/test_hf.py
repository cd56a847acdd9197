"""The transformers backend on the tiny random Qwen3: batching parity, sampling, stops, cancellation.

Every test talks to one real backend (module scope) and compares against
plain forward passes of an independently loaded copy of the same weights.
This random model's greedy choice mostly repeats the previous token, so token
ids alone prove little; the parity test also compares every step's logprobs,
which a wrong position id or an unmasked pad moves by ~0.1.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch")

import pytest_asyncio  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from engine.backends.base import (  # noqa: E402
    Backend,
    BackendError,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
)
from engine.backends.hf import HFBackend, HFBackendConfig  # noqa: E402
from wire.protocol import GenerateLogProbsContent, SamplingParams  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

VOCAB = 151_669  # the Qwen3 tokenizer's size; the embedding is padded to 151,936
TOLERANCE = 1e-4
GONE_WITHIN_S = 2.0  # how long a closed or aborted request may linger in running()
OUTLAST = 2000
"""max_tokens of a request that must still be decoding when others sharing its batch are done."""


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[GenerateLogProbsContent] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None

    def add(self, output: BackendOutput) -> None:
        assert self.finish_reason is None, "output after the finish"
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


class Run:
    """One request's choices, filled in as its outputs arrive."""

    def __init__(self) -> None:
        self.choices: dict[int, Choice] = {}

    def feed(self, outputs: list[BackendOutput]) -> None:
        for output in outputs:
            self.choices.setdefault(output.index, Choice()).add(output)

    @property
    def only(self) -> Choice:
        assert list(self.choices) == [0]
        return self.choices[0]

    def count(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def reached(self, tokens: int) -> bool:
        return self.count() >= tokens


def request(request_id: str, prompt: list[int], eos: frozenset[int] = frozenset(), **sampling: Any) -> BackendRequest:
    return BackendRequest(request_id, prompt, SamplingParams(**sampling), eos_token_ids=eos)


async def collect(backend: HFBackend, req: BackendRequest, run: Run | None = None) -> Run:
    run = run or Run()
    async for outputs in backend.generate(req):
        run.feed(outputs)
    return run


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """The same weights, loaded separately, for plain single-sequence forward passes."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tiny_model_dir: Path) -> AsyncIterator[HFBackend]:
    hf = HFBackend(HFBackendConfig(model=str(tiny_model_dir), max_batch_size=8))
    await hf.start()
    yield hf
    await hf.close()


@pytest.fixture(scope="module")
def prompts(qwen3_tokenizer: Any) -> list[list[int]]:
    texts = ["Hello", "The quick brown fox jumps over", "Once upon a time, in a land far away, there lived a parser"]
    return [qwen3_tokenizer.encode(text) for text in texts]


def greedy_reference(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[Any]]:
    """Plain greedy decode of one sequence: token ids and each step's raw log_softmax."""
    cache = DynamicCache(config=model.config)
    ids, tokens, logprobs = torch.tensor([prompt]), [], []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1, :VOCAB]
            step = logits.float().log_softmax(-1)
            tokens.append(int(step.argmax()))
            logprobs.append(step)
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


def forward_logprobs(model: Any, prompt: list[int], output: list[int]) -> Any:
    """Raw log_softmax predicting each output token, from one uncached forward pass."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :, :VOCAB]
    return logits.float().log_softmax(-1)


async def test_is_a_backend(backend: HFBackend, tiny_model_dir: Path) -> None:
    assert isinstance(backend, Backend)
    info = backend.info
    assert (info.name, info.model, info.max_model_len, info.vocab_size) == ("hf", tiny_model_dir.name, 4096, VOCAB)
    assert info.eos_token_ids == {151645, 151643}


# ------------------------------------------------------------ 1. batching parity


async def test_greedy_joins_mid_flight_match_single_sequence_decode(
    backend: HFBackend, reference: Any, prompts: list[list[int]]
) -> None:
    steps = 24
    # Longest first: it pads the later ones on join and leaves first, so the
    # padding no remaining row needs is cut while the others still decode.
    prompts = sorted(prompts, key=len, reverse=True)
    runs = [Run() for _ in prompts]
    tasks = []
    for i, prompt in enumerate(prompts):
        req = request(f"parity-{i}", prompt, max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=3)
        tasks.append(asyncio.create_task(collect(backend, req, runs[i])))
        if i + 1 < len(prompts):
            await wait_until(functools.partial(runs[i].reached, 4), what=f"run {i} has 4 tokens")
    # The last one got its first token while the first was still decoding: they shared steps.
    await wait_until(lambda: runs[-1].count() >= 1, what="the last run's first token")
    assert runs[0].only.finish_reason is None
    await asyncio.gather(*tasks)
    for prompt, run in zip(prompts, runs, strict=True):
        tokens, logprobs = greedy_reference(reference, prompt, steps)
        choice = run.only
        assert choice.token_ids == tokens
        assert (choice.finish_reason, choice.stop_reason) == ("length", None)
        for entry, step in zip(choice.logprobs, logprobs, strict=True):
            for candidate in entry.top_logprobs:
                assert candidate.logprob == pytest.approx(float(step[candidate.token_id]), abs=TOLERANCE)


# ------------------------------------------------------------ 2. seeded sampling


async def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(
    backend: HFBackend, prompts: list[list[int]]
) -> None:
    params: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "ignore_eos": True}
    alone = await collect(backend, request("seed-alone", prompts[1], seed=1234, **params))
    # The others outlast the seeded requests by far, and are aborted once those are done.
    runs = [Run(), Run()]
    others = [
        asyncio.create_task(collect(backend, request("seed-other-0", prompts[2], **{**params, "max_tokens": OUTLAST}), runs[0])),
        asyncio.create_task(collect(backend, request("seed-other-1", prompts[0], max_tokens=OUTLAST, temperature=0.0), runs[1])),
    ]
    # The others hold their rows first: each has its first token, so the seeded one joins a batch.
    await wait_until(lambda: all(run.count() >= 1 for run in runs), what="the others decode")
    shared = await collect(backend, request("seed-shared", prompts[1], seed=1234, **params))
    other_seed = await collect(backend, request("seed-other", prompts[1], seed=4321, **params))
    assert all(run.only.finish_reason is None for run in runs), "the seeded requests decoded alone"
    for name in ("seed-other-0", "seed-other-1"):
        await backend.abort(name)
    await asyncio.gather(*others)
    assert len(alone.only.token_ids) == 16
    assert shared.only.token_ids == alone.only.token_ids
    assert other_seed.only.token_ids != alone.only.token_ids


async def test_top_k_and_top_p_keep_only_their_candidates(backend: HFBackend, prompts: list[list[int]]) -> None:
    a, b, c = 1000, 2000, 3000
    # Biases make three tokens hold ~all the mass: about 0.665, 0.245 and 0.090.
    bias = {a: 20.0, b: 19.0, c: 18.0}
    params: dict[str, Any] = {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True, "logit_bias": bias, "seed": 11}

    async def tokens(request_id: str, **extra: Any) -> list[int]:
        return (await collect(backend, request(request_id, prompts[0], **params, **extra))).only.token_ids

    assert set(await tokens("all-three")) == {a, b, c}
    nucleus = await tokens("top-p", top_p=0.8)
    assert set(nucleus) == {a, b}
    assert set(await tokens("top-k2", top_k=2)) == {a, b}
    assert set(await tokens("top-k1", top_k=1)) == {a}
    assert set(await tokens("top-k2-p", top_k=2, top_p=0.6)) == {a}  # a alone holds ~0.73 of the two
    busy_run = Run()
    busy = asyncio.create_task(collect(backend, request("busy", prompts[2], max_tokens=OUTLAST, temperature=0.0), busy_run))
    await wait_until(lambda: busy_run.count() >= 1, what="the busy request decodes")
    assert await tokens("top-p-shared", top_p=0.8) == nucleus
    assert busy_run.only.finish_reason is None, "the nucleus request decoded alone"
    await backend.abort("busy")
    await busy


# ------------------------------------------------------------ 3. logprobs


async def test_greedy_logprobs_match_an_independent_forward_pass(
    backend: HFBackend, reference: Any, prompts: list[list[int]]
) -> None:
    prompt, k = prompts[2], 5
    run = await collect(backend, request("lp-greedy", prompt, max_tokens=6, temperature=0.0, logprobs=k))
    choice = run.only
    expected = forward_logprobs(reference, prompt, choice.token_ids)
    assert len(choice.logprobs) == len(choice.token_ids) == 6
    for token, entry, step in zip(choice.token_ids, choice.logprobs, expected, strict=True):
        assert (entry.token_id, entry.rank) == (token, 1)
        assert entry.logprob == pytest.approx(float(step[token]), abs=TOLERANCE)
        top = entry.top_logprobs
        # The sampled token is also the best candidate, so it is listed once, first.
        assert top[0].token_id == token and len(top) == k
        assert [c.rank for c in top] == list(range(1, k + 1))
        assert [c.logprob for c in top] == sorted((c.logprob for c in top), reverse=True)
        best = step.topk(k)
        assert [c.token_id for c in top] == best.indices.tolist()
        assert [c.logprob for c in top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)


async def test_sampled_logprobs_rank_the_sampled_token(
    backend: HFBackend, reference: Any, prompts: list[list[int]]
) -> None:
    prompt = prompts[0]
    req = request("lp-sampled", prompt, max_tokens=6, temperature=1.0, seed=7, logprobs=2, ignore_eos=True)
    choice = (await collect(backend, req)).only
    expected = forward_logprobs(reference, prompt, choice.token_ids)
    for token, entry, step in zip(choice.token_ids, choice.logprobs, expected, strict=True):
        value = float(step[token])
        assert entry.rank is not None
        assert entry.token_id == token and entry.logprob == pytest.approx(value, abs=TOLERANCE)
        # Near-ties within the tolerance may land on either side.
        assert int((step > value + TOLERANCE).sum()) + 1 <= entry.rank <= int((step >= value - TOLERANCE).sum())
        top = entry.top_logprobs
        assert top[0].token_id == token
        assert [c.token_id for c in top[1:]] == [t for t in step.topk(2).indices.tolist() if t != token]


async def test_all_logprobs_are_capped_at_20(backend: HFBackend, prompts: list[list[int]]) -> None:
    run = await collect(backend, request("lp-all", prompts[0], max_tokens=2, temperature=0.0, logprobs=-1))
    assert all(len(entry.top_logprobs) == 20 for entry in run.only.logprobs)


# ------------------------------------------------------------ 4. n > 1


async def test_n2_returns_two_seeded_choices(backend: HFBackend, prompts: list[list[int]]) -> None:
    params: dict[str, Any] = {"temperature": 1.0, "max_tokens": 5, "ignore_eos": True}
    run = await collect(backend, request("n2", prompts[1], n=2, seed=99, **params))
    assert sorted(run.choices) == [0, 1]
    first, second = run.choices[0], run.choices[1]
    assert len(first.token_ids) == len(second.token_ids) == 5
    assert first.finish_reason == second.finish_reason == "length"
    assert first.token_ids != second.token_ids
    # Choice i draws from seed + i, as vLLM seeds its n>1 children.
    single = await collect(backend, request("n2-single", prompts[1], seed=100, **params))
    assert single.only.token_ids == second.token_ids


# ------------------------------------------------------------ 5. stop conditions


async def test_max_tokens_ends_with_length(backend: HFBackend, prompts: list[list[int]]) -> None:
    choice = (await collect(backend, request("len", prompts[0], max_tokens=5, temperature=0.0))).only
    assert len(choice.token_ids) == 5
    assert (choice.finish_reason, choice.stop_reason) == ("length", None)


async def test_stop_token_and_eos_end_the_choice(backend: HFBackend, prompts: list[list[int]]) -> None:
    params: dict[str, Any] = {"temperature": 1.0, "seed": 5, "max_tokens": 12}
    free = (await collect(backend, request("free", prompts[1], ignore_eos=True, **params))).only.token_ids
    target = free[4]
    assert target not in free[:4]
    stopped = (await collect(backend, request("stop-id", prompts[1], stop_token_ids=[target], **params))).only
    assert stopped.token_ids == free[:5]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)
    eos = frozenset({target})
    ended = (await collect(backend, request("eos", prompts[1], eos=eos, **params))).only
    assert ended.token_ids == free[:5]  # the EOS token is part of the output, as in vLLM
    assert (ended.finish_reason, ended.stop_reason) == ("stop", None)
    ignored = (await collect(backend, request("eos-ignored", prompts[1], eos=eos, ignore_eos=True, **params))).only
    assert ignored.token_ids == free and ignored.finish_reason == "length"


async def test_min_tokens_holds_back_eos_and_stop_ids(backend: HFBackend, prompts: list[list[int]]) -> None:
    target = 9707
    # A bias makes the target certain as soon as it is allowed.
    params: dict[str, Any] = {"temperature": 0.0, "max_tokens": 10, "min_tokens": 3, "logit_bias": {target: 100.0}}
    ended = (await collect(backend, request("min-eos", prompts[0], eos=frozenset({target}), **params))).only
    assert len(ended.token_ids) == 4 and target not in ended.token_ids[:3]
    assert (ended.token_ids[-1], ended.finish_reason, ended.stop_reason) == (target, "stop", None)
    stopped = (await collect(backend, request("min-stop", prompts[0], stop_token_ids=[target], **params))).only
    assert stopped.token_ids == ended.token_ids
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)


async def test_model_length_ends_with_length(backend: HFBackend) -> None:
    prompt = [100 + i % 1000 for i in range(4093)]
    choice = (await collect(backend, request("ctx", prompt, max_tokens=None, temperature=0.0, ignore_eos=True))).only
    assert len(choice.token_ids) == 3  # 4093 + 3 = max_model_len
    assert choice.finish_reason == "length"


async def test_penalties_and_allowed_ids_shape_the_choice(backend: HFBackend, prompts: list[list[int]]) -> None:
    params: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    plain = (await collect(backend, request("plain", prompts[0], **params))).only.token_ids
    assert len(set(plain)) < len(plain)  # this model's greedy choice repeats itself
    for name in ("frequency_penalty", "presence_penalty"):
        penalized = (await collect(backend, request(name, prompts[0], **{**params, name: 1.0}))).only.token_ids
        assert len(set(penalized)) == len(penalized)
    allowed = [11, 22, 33]
    req = request("allowed", prompts[0], allowed_token_ids=allowed, **{**params, "temperature": 1.0})
    assert set((await collect(backend, req)).only.token_ids) <= set(allowed)


# ------------------------------------------------------------ 6. abort and close


async def test_closing_the_generator_stops_the_request(backend: HFBackend, prompts: list[list[int]]) -> None:
    generator = backend.generate(request("closed", prompts[0], max_tokens=2000, ignore_eos=True))
    seen = 0
    async for outputs in generator:
        seen += len(outputs)
        if seen >= 3:
            break
    await generator.aclose()
    await wait_until(lambda: "closed" not in backend.running(), timeout=GONE_WITHIN_S)
    assert backend.running() == frozenset()
    after = await collect(backend, request("after-close", prompts[0], max_tokens=3))
    assert len(after.only.token_ids) == 3


async def test_abort_by_id_ends_the_stream(backend: HFBackend, prompts: list[list[int]]) -> None:
    run = Run()
    task = asyncio.create_task(collect(backend, request("aborted", prompts[1], max_tokens=2000, ignore_eos=True), run))
    await wait_until(lambda: run.count() >= 3)
    await asyncio.wait_for(backend.abort("aborted"), GONE_WITHIN_S)
    assert "aborted" not in backend.running()
    await asyncio.wait_for(task, GONE_WITHIN_S)
    assert run.only.finish_reason == "abort" and len(run.only.token_ids) < 2000
    await backend.abort("no-such-request")
    after = await collect(backend, request("after-abort", prompts[1], max_tokens=3))
    assert len(after.only.token_ids) == 3


async def test_cancelling_the_consumer_stops_the_request(backend: HFBackend, prompts: list[list[int]]) -> None:
    run = Run()
    long_request = request("cancelled", prompts[2], max_tokens=2000, ignore_eos=True)
    task = asyncio.create_task(collect(backend, long_request, run))
    await wait_until(lambda: run.count() >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: "cancelled" not in backend.running(), timeout=GONE_WITHIN_S)


async def test_abort_during_prefill_releases_a_request_that_ended_there(
    backend: HFBackend, prompts: list[list[int]]
) -> None:
    entered, go = threading.Event(), threading.Event()

    def hold_prefill(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape[1] > 1 and not entered.is_set():
            entered.set()
            go.wait(GONE_WITHIN_S)

    # The prefill waits in the worker thread until the abort has been asked for.
    handle = backend._model.register_forward_pre_hook(hold_prefill, with_kwargs=True)
    try:
        run = Run()
        task = asyncio.create_task(collect(backend, request("held", prompts[2], max_tokens=1), run))
        assert await asyncio.to_thread(entered.wait, GONE_WITHIN_S)
        abort = asyncio.create_task(backend.abort("held"))
        # The abort is asked for (the request marked gone) while its prefill is still held.
        await wait_until(lambda: backend._requests["held"].gone, what="the abort is asked for")
        go.set()
        await asyncio.wait_for(abort, GONE_WITHIN_S)
        await asyncio.wait_for(task, GONE_WITHIN_S)
    finally:
        go.set()
        handle.remove()
    assert backend.running() == frozenset()
    assert run.only.finish_reason == "abort" and run.only.token_ids == []


async def test_a_failed_forward_pass_fails_its_requests_only(backend: HFBackend, prompts: list[list[int]]) -> None:
    fired: list[bool] = []

    def fail_one_decode(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not fired and kwargs["input_ids"].shape[1] == 1:
            fired.append(True)
            raise RuntimeError("injected fault")

    # Fault injection into the real model, not a mock: the next decode step raises once.
    handle = backend._model.register_forward_pre_hook(fail_one_decode, with_kwargs=True)
    try:
        with pytest.raises(BackendError, match="injected fault"):
            await collect(backend, request("faulty", prompts[0], max_tokens=20))
    finally:
        handle.remove()
    assert backend.running() == frozenset()
    after = await collect(backend, request("after-fault", prompts[0], max_tokens=3))
    assert len(after.only.token_ids) == 3


# ------------------------------------------------------------ 7. bad requests


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([1, VOCAB, 2], {}, "out of vocabulary"),
        ([1, -1], {}, "out of vocabulary"),
        ([1] * 4097, {}, "longer than the maximum model length"),
        ([], {}, "at least one token"),
        ([1, 2], {"n": 9}, "max_batch_size"),
        ([1, 2], {"allowed_token_ids": [VOCAB]}, "out of vocabulary"),
        ([1, 2], {"prompt_logprobs": 1}, "does not support prompt_logprobs"),
    ],
)
async def test_bad_requests_fail_before_any_output(
    backend: HFBackend, prompt: list[int], sampling: dict[str, Any], message: str
) -> None:
    generator = backend.generate(request("bad", prompt, **sampling))
    with pytest.raises(BackendRequestError, match=message):
        await anext(generator)
    assert "bad" not in backend.running()


async def test_a_running_id_cannot_be_reused(backend: HFBackend, prompts: list[list[int]]) -> None:
    first = backend.generate(request("twice", prompts[0], max_tokens=2000, ignore_eos=True))
    await anext(first)
    with pytest.raises(BackendRequestError, match="already running"):
        await anext(backend.generate(request("twice", prompts[0])))
    await first.aclose()


async def test_config_is_strict() -> None:
    assert msgspec.convert({"model": "m"}, HFBackendConfig).max_batch_size == 16
    for bad in ({"bogus": 1}, {"max_batch_size": 0}, {"dtype": "int8"}, {"device": "tpu"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"model": "m", **bad}, HFBackendConfig)


async def test_a_missing_model_folder_fails_start(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="does not exist"):
        await HFBackend(HFBackendConfig(model=str(tmp_path / "missing"))).start()


async def test_generate_needs_start(tiny_model_dir: Path) -> None:
    idle = HFBackend(HFBackendConfig(model=str(tiny_model_dir)))
    with pytest.raises(BackendError, match="not running"):
        await anext(idle.generate(request("early", [1, 2])))
    await idle.close()
