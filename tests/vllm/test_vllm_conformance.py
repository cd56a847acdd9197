"""Stock vLLM 0.32 and onehop's engine over the `vllm` backend answer `/inference/v1/generate` alike.

Both servers run from vLLM's venv on the tiny Qwen3 model and get the same
greedy requests; responses are decoded with `wire.protocol` and compared.
The differences allowed, each asserted where it shows (so a change on either
side is noticed):

- `request_id`: vLLM answers `generate-tokens-<id>` (in text mode too);
  onehop echoes `<id>`. `created` is a timestamp.
- `weight_versions`: vLLM puts its weight-version span on the final choice
  (`[{"version": "default", "start": 0, "end": n}]`); onehop sends null,
  because `BackendOutput` has no field to carry it.
- stream chunk boundaries: a chunk may carry several tokens when a consumer
  lags (vLLM's output collector merges deltas; onehop's engine coalesces),
  so ids, text and logprobs are compared concatenated per choice, and chunk
  shapes as a set.
- stream encoding: onehop leaves out fields at their defaults (null, [])
  in chunks, where vLLM writes them (see `wire/protocol.py`); chunk shapes
  compare the keys whose values are not null. Non-streaming bodies carry
  every key on both sides and are compared key for key.
- onehop adds an SSE comment (`: onehop-engine-cpu-us=N`) before `[DONE]`;
  SSE clients skip comments.
- error bodies: both are OpenAI-shaped with code 400; message, `type`
  (`"Bad Request"` vs `"BadRequestError"`) and `param` differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from wire.protocol import (
    EngineError,
    GenerateTextResponse,
    GenerateTextStreamResponse,
    GenerateTokensResponse,
    GenerateTokensStreamResponse,
    OutputMode,
    decode_generate_response,
    decode_generate_stream_chunk,
)
from tests.support.ports import free_port
from tests.vllm.conftest import ROOT, chat_prompt_ids, has_done, post, server_env, servers, sse_payloads

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 2048
MAX_TOKENS = 12
TOP_LOGPROBS = 2
# Logprobs come from the same vLLM kernels in both servers; allow float noise only.
LOGPROB_DIGITS = 4
GENERATE = "/inference/v1/generate"
VLLM_REQUEST_ID_PREFIX = "generate-tokens-"
PEERS = ("stock", "onehop")
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# vLLM refuses n > 1 with greedy sampling; a seed makes sampling repeatable on both servers.
SEEDED_N2: dict[str, Any] = {"temperature": 0.8, "seed": 1, "n": 2, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CASES = {
    "greedy": GREEDY,
    "greedy-logprobs": {**GREEDY, "logprobs": TOP_LOGPROBS},
    "seeded-n2": SEEDED_N2,
    # The stop token id is the greedy answer's 4th token, filled in by `sampling_for`.
    "stop-token": {"temperature": 0, "max_tokens": MAX_TOKENS},
}


@pytest.fixture(scope="module")
def engines(vllm_python: Path, tiny_model_dir: Path) -> Iterator[dict[str, str]]:
    """Both servers, started together once for the module: name → base URL."""
    model = str(tiny_model_dir)
    stock_port, onehop_port = free_port(), free_port()
    stock = ["bash", str(ROOT / "scripts" / "vllm_serve.sh"), model, str(stock_port)]
    onehop = [str(vllm_python), "-m", "onehop", "engine", "--backend", "vllm", "--model", model]
    specs = [
        ("stock vLLM", [*stock, "--max-model-len", str(MAX_MODEL_LEN)], stock_port),
        (
            "onehop engine (vllm backend)",
            [*onehop, "--port", str(onehop_port), "--backend-option", f"max_model_len={MAX_MODEL_LEN}"],
            onehop_port,
        ),
    ]
    with servers(specs, server_env(ONEHOP_VLLM_PYTHON=str(vllm_python))) as (stock_server, onehop_server):
        yield {"stock": stock_server.url, "onehop": onehop_server.url}


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer: Any) -> list[int]:
    return chat_prompt_ids(qwen3_tokenizer, "Name three colours.")


@pytest.fixture(scope="module")
def greedy_ids(engines: dict[str, str], prompt: list[int]) -> list[int]:
    """Stock vLLM's greedy answer, to pick a stop token that is really generated."""
    status, answer = post(engines["stock"] + GENERATE, generate_body("conf-probe", prompt, "tokens", False, GREEDY))
    assert status == 200, answer[:500]
    return list(decode_generate_response(answer, "tokens").choices[0].token_ids or ())


def sampling_for(case: str, greedy_ids: list[int]) -> dict[str, Any]:
    if case == "stop-token":
        return {**CASES[case], "stop_token_ids": [greedy_ids[3]]}
    return CASES[case]


def expected_finish(case: str, greedy_ids: list[int]) -> tuple[str, int | None]:
    return ("stop", greedy_ids[3]) if case == "stop-token" else ("length", None)


def generate_body(
    rid: str, prompt: list[int], mode: OutputMode, stream: bool, sampling: dict[str, Any]
) -> bytes:
    body: dict[str, Any] = {
        "request_id": rid,
        "token_ids": prompt,
        "sampling_params": sampling,
        "output_mode": mode,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def ask_both(engines: dict[str, str], body: bytes) -> dict[str, bytes]:
    answers: dict[str, bytes] = {}
    for name in PEERS:
        status, answer = post(engines[name] + GENERATE, body)
        assert status == 200, f"{name}: {status} {answer[:500]!r}"
        answers[name] = answer
    return answers


def generated(answer: bytes, mode: OutputMode) -> GenerateTokensResponse | GenerateTextResponse:
    """A tokens or text generate answer (these tests ask for no other mode)."""
    response = decode_generate_response(answer, mode)
    assert isinstance(response, GenerateTokensResponse | GenerateTextResponse)
    return response


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_same_response(
    engines: dict[str, str], prompt: list[int], greedy_ids: list[int], mode: OutputMode, case: str
) -> None:
    rid = f"conf-json-{mode}-{case}"
    answers = ask_both(engines, generate_body(rid, prompt, mode, False, sampling_for(case, greedy_ids)))
    raw = {name: json.loads(answer) for name, answer in answers.items()}
    # Non-streaming bodies carry every key on both sides.
    assert set(raw["onehop"]) == set(raw["stock"])
    assert [set(c) for c in raw["onehop"]["choices"]] == [set(c) for c in raw["stock"]["choices"]]

    stock, onehop = (generated(answers[name], mode) for name in PEERS)
    assert stock.request_id == VLLM_REQUEST_ID_PREFIX + rid
    assert onehop.request_id == rid
    finish, stop_reason = expected_finish(case, greedy_ids)
    for s, o in zip(stock.choices, onehop.choices, strict=True):
        assert (s.finish_reason, s.stop_reason) == (finish, stop_reason)
        if finish == "length":
            assert len(s.token_ids or ()) == MAX_TOKENS
        assert o.weight_versions in (None, s.weight_versions)
    assert comparable(onehop) == comparable(stock)


def comparable(response: Any) -> Any:
    """A decoded response as builtins, without the allowed differences, logprobs rounded."""
    data = msgspec.to_builtins(response)
    data.pop("request_id")
    data.pop("created")
    for choice in data["choices"]:
        choice.pop("weight_versions")
    return rounded(data)


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, LOGPROB_DIGITS)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_same_stream(
    engines: dict[str, str], prompt: list[int], greedy_ids: list[int], mode: OutputMode, case: str
) -> None:
    rid = f"conf-sse-{mode}-{case}"
    sampling = sampling_for(case, greedy_ids)
    answers = ask_both(engines, generate_body(rid, prompt, mode, True, sampling))
    for name, answer in answers.items():
        assert has_done(answer), f"{name} did not end its stream with [DONE]"
    payloads = {name: sse_payloads(answer) for name, answer in answers.items()}
    shapes = {name: {chunk_shape(json.loads(p)) for p in payloads[name]} for name in PEERS}
    assert shapes["onehop"] == shapes["stock"]

    folded = {name: fold(payloads[name], mode, "logprobs" in sampling) for name in PEERS}
    assert folded["stock"]["request_ids"] == {VLLM_REQUEST_ID_PREFIX + rid}
    assert folded["onehop"]["request_ids"] == {rid}
    finish, stop_reason = expected_finish(case, greedy_ids)
    stock_choices = folded["stock"]["choices"]
    assert len(stock_choices) == sampling.get("n", 1)
    assert {(c["finish_reason"], c["stop_reason"]) for c in stock_choices} == {(finish, stop_reason)}
    for name in PEERS:
        del folded[name]["request_ids"]
    assert folded["onehop"] == folded["stock"]


def chunk_shape(chunk: Any) -> Any:
    """The keys with non-null values, recursively; list elements as a set of shapes."""
    if isinstance(chunk, dict):
        return frozenset(
            (key, chunk_shape(value))
            for key, value in chunk.items()
            if value is not None and key != "weight_versions"
        )
    if isinstance(chunk, list):
        return ("list", frozenset(chunk_shape(item) for item in chunk))
    return type(chunk).__name__


def fold(payloads: list[bytes], mode: OutputMode, with_logprobs: bool) -> dict[str, Any]:
    """A stream's chunks decoded and concatenated per choice; checks one choice per event."""
    choices: dict[int, dict[str, Any]] = {}
    request_ids: set[str] = set()
    usage: list[Any] = []
    for payload in payloads:
        chunk = decode_generate_stream_chunk(payload, mode)
        # A tokens or text stream (these tests ask for no other mode).
        assert isinstance(chunk, GenerateTokensStreamResponse | GenerateTextStreamResponse)
        request_ids.add(chunk.request_id)
        if not chunk.choices:  # the usage chunk (stream_options.include_usage)
            usage.append(msgspec.to_builtins(chunk.usage))
            continue
        (choice,) = chunk.choices
        folded = choices.setdefault(
            choice.index, {"token_ids": [], "text": "", "logprobs": [], "finish_reason": None, "stop_reason": None}
        )
        assert folded["finish_reason"] is None, "a chunk after the choice finished"
        ids = choice.token_ids or []
        folded["token_ids"] += ids
        folded["text"] += getattr(choice, "text", "")
        if with_logprobs:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert len(choice.logprobs.content) == len(ids)
            folded["logprobs"] += rounded(msgspec.to_builtins(choice.logprobs.content))
        folded["finish_reason"] = choice.finish_reason
        folded["stop_reason"] = choice.stop_reason
    assert len(usage) == 1, "include_usage: exactly one usage chunk"
    return {"request_ids": request_ids, "choices": [choices[i] for i in sorted(choices)], "usage": usage}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_text_mode_without_detokenize_is_refused(
    engines: dict[str, str], prompt: list[int], stream: bool
) -> None:
    body = {
        "token_ids": prompt,
        "sampling_params": {**GREEDY, "detokenize": False},
        "output_mode": "text",
        "stream": stream,
    }
    for name in PEERS:
        status, answer = post(engines[name] + GENERATE, json.dumps(body).encode())
        assert status == 400, f"{name}: {status} {answer[:500]!r}"
        with pytest.raises(EngineError) as refused:
            decode_generate_response(answer, "text")
        assert refused.value.info.code == 400, name


# ------------------------------------------------------------ defaults where vLLM's behaviour is the contract


def test_text_logprobs_zero_lists_the_sampled_token(engines: dict[str, str], prompt: list[int]) -> None:
    sampling = {**GREEDY, "max_tokens": 3, "logprobs": 0}
    answers = ask_both(engines, generate_body("conf-lp0", prompt, "text", False, sampling))
    stock, onehop = (decode_generate_response(answers[name], "text") for name in PEERS)
    assert comparable(onehop) == comparable(stock)


def test_unset_max_tokens_fills_the_context(engines: dict[str, str], prompt: list[int]) -> None:
    # A prompt 40 tokens short of the context: vLLM's default stays small, and above onehop's 16.
    room = 40
    long_prompt = (prompt * (MAX_MODEL_LEN // len(prompt) + 1))[: MAX_MODEL_LEN - room]
    answers = ask_both(
        engines, generate_body("conf-no-max", long_prompt, "tokens", False, {"temperature": 0, "ignore_eos": True})
    )
    stock, onehop = (decode_generate_response(answers[name], "tokens") for name in PEERS)
    assert len(stock.choices[0].token_ids or ()) == room
    assert comparable(onehop) == comparable(stock)


STRUCTURED = {
    "json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False},
}


@pytest.mark.parametrize("constraint", [{"json": STRUCTURED["json"]}, {"choice": ["yes", "no"]}], ids=["json", "choice"])
def test_structured_outputs_agree(engines: dict[str, str], qwen3_tokenizer: Any, constraint: dict[str, Any]) -> None:
    """A constrained greedy request: onehop's vllm backend hands the constraint to vLLM's own
    grammar backend, so both servers give the same schema-valid answer."""
    prompt = chat_prompt_ids(qwen3_tokenizer, "Answer.", enable_thinking=False)
    sampling = {"temperature": 0, "max_tokens": 32, "structured_outputs": constraint}
    answers = ask_both(engines, generate_body("conf-structured", prompt, "text", False, sampling))
    stock, onehop = (generated(answers[name], "text") for name in PEERS)
    assert isinstance(stock, GenerateTextResponse) and isinstance(onehop, GenerateTextResponse)
    texts = [r.choices[0].text for r in (stock, onehop)]
    assert texts[0] == texts[1], texts
    if "json" in constraint:  # the random model spends its 32 tokens in the whitespace JSON allows
        assert texts[0].startswith("{")
    else:
        assert texts[0] in ("yes", "no")
