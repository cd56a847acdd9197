"""Drive onehop's `vllm` backend on a model, print one JSON report (run in vLLM's venv).

    <vllm-venv>/bin/python tests/vllm/run_vllm_backend.py MODEL_DIR

`tests/vllm/test_vllm_backend.py` runs this and asserts on the report; it
lives in a script because vLLM is not in the project's venv. The `__main__`
guard is required: vLLM on CPU spawns its engine core, which re-imports the
main module.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GREEDY_TOKENS = 16
TOP_LOGPROBS = 3
LONG_TOKENS = 2000
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# vLLM refuses n > 1 with greedy sampling; seeded sampling keeps the run repeatable.
SEEDED = {"temperature": 0.8, "seed": 1}
# How long an aborted request may take to leave vLLM's scheduler.
DRAIN_TIMEOUT_S = 10.0


def chat_prompt(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def sampling(**fields: Any) -> Any:
    from wire.protocol import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **fields})


def request(rid: str, prompt: list[int], **fields: Any) -> Any:
    from engine.backends.base import BackendRequest

    return BackendRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling(**fields))


async def collect(backend: Any, req: Any) -> dict[str, Any]:
    """Every step of a request folded per choice, plus how many steps there were."""
    choices: dict[int, dict[str, Any]] = {}
    steps = 0
    async for batch in backend.generate(req):
        steps += 1
        for out in batch:
            choice = choices.setdefault(out.index, {"token_ids": [], "logprobs": [], "finish_reason": None})
            if choice["finish_reason"] is not None:
                choice["after_finish"] = True
            choice["token_ids"] += out.token_ids
            if out.logprobs is not None:
                choice["logprobs"] += [_logprob(e) for e in out.logprobs]
            choice["finish_reason"] = out.finish_reason
            choice["stop_reason"] = out.stop_reason
            choice["num_cached_tokens"] = out.num_cached_tokens
    return {"steps": steps, "choices": [choices[i] for i in sorted(choices)]}


def _logprob(entry: Any) -> dict[str, Any]:
    return {
        "token_id": entry.token_id,
        "logprob": entry.logprob,
        "rank": entry.rank,
        "top": [[c.token_id, c.logprob, c.rank] for c in entry.top_logprobs],
    }


async def abort_by_close(backend: Any, prompt: list[int]) -> dict[str, Any]:
    stream = backend.generate(request("close-me", prompt, max_tokens=LONG_TOKENS, n=2, **SEEDED))
    seen = 0
    running_during: list[str] = []
    async for batch in stream:
        seen += sum(len(out.token_ids) for out in batch)
        running_during = sorted(backend.running())
        if seen >= 4:
            break
    started = time.monotonic()
    await stream.aclose()
    return {
        "tokens_before_close": seen,
        "running_during": running_during,
        "running_after": sorted(backend.running()),
        "vllm_unfinished_s": await _drained(backend, started),
    }


async def abort_by_id(backend: Any, prompt: list[int]) -> dict[str, Any]:
    stream = backend.generate(request("abort-me", prompt, max_tokens=LONG_TOKENS, n=2, **SEEDED))
    finishes: dict[int, str | None] = {}
    tokens = 0
    started = time.monotonic()
    async for batch in stream:
        for out in batch:
            tokens += len(out.token_ids)
            finishes[out.index] = out.finish_reason
        if tokens >= 4 and "abort-me" in backend.running():
            await backend.abort("abort-me")
    return {
        "tokens": tokens,
        "finishes": [finishes[i] for i in sorted(finishes)],
        "ended_in_s": round(time.monotonic() - started, 3),
        "running_after": sorted(backend.running()),
    }


async def _drained(backend: Any, since: float) -> float | None:
    """Seconds until vLLM has no unfinished request, None if not within the timeout."""
    llm = backend._llm
    while time.monotonic() - since < DRAIN_TIMEOUT_S:
        if llm.get_num_unfinished_requests() == 0:
            return round(time.monotonic() - since, 3)
        await asyncio.sleep(0.02)
    return None


async def refused(backend: Any, req: Any) -> str | None:
    """The error type name a request is refused with, None if it generated."""
    try:
        async for _ in backend.generate(req):
            pass
    except Exception as exc:  # the report names what was raised; the test asserts on it
        return type(exc).__name__
    return None


async def main(model_dir: str) -> dict[str, Any]:
    from engine.backends.vllm import VLLMBackend, VLLMBackendConfig

    prompt = chat_prompt(model_dir)
    backend = VLLMBackend(VLLMBackendConfig(model=model_dir, max_model_len=2048))
    started = time.monotonic()
    await backend.start()
    report: dict[str, Any] = {"start_s": round(time.monotonic() - started, 1)}
    try:
        info = backend.info
        report["info"] = {
            "name": info.name,
            "model": info.model,
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
            "eos_token_ids": sorted(info.eos_token_ids),
        }
        report["prompt_len"] = len(prompt)
        report["greedy"] = await collect(backend, request("greedy", prompt, max_tokens=GREEDY_TOKENS))
        report["greedy_again"] = await collect(backend, request("greedy-2", prompt, max_tokens=GREEDY_TOKENS))
        report["n2_logprobs"] = await collect(
            backend, request("n2", prompt, max_tokens=GREEDY_TOKENS, n=2, logprobs=TOP_LOGPROBS, **SEEDED)
        )
        report["refused_greedy_n2"] = await refused(backend, request("greedy-n2", prompt, n=2))
        report["abort_by_close"] = await abort_by_close(backend, prompt)
        report["abort_by_id"] = await abort_by_id(backend, prompt)
        report["refused_out_of_vocab"] = await refused(
            backend, request("oov", [info.vocab_size + 5], max_tokens=2)
        )
        report["refused_too_long"] = await refused(
            backend, request("long", prompt * (info.max_model_len // len(prompt) + 1), max_tokens=2)
        )
        report["running_at_end"] = sorted(backend.running())
    finally:
        await backend.close()
    return report


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(main(sys.argv[1]))
    # Last line of stdout: vLLM logs to stderr, but keep the report easy to find.
    print(json.dumps(result), flush=True)
