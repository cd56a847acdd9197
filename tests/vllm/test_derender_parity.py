"""onehop's stateful derender against vLLM 0.32's own in-process parsers (opt-in: needs vLLM's venv)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_bench_derender import load_bench

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def bench() -> Any:
    module = load_bench()
    if module.default_vllm_python() is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh or set ONEHOP_VLLM_PYTHON")
    return module


def testsame_answer_as_vllm_coupled_parsing(bench: Any, qwen3_tokenizer: Any, qwen3_tokenizer_dir: Any) -> None:
    vocab = bench.vocab_for(qwen3_tokenizer)
    work = bench.build_workloads(qwen3_tokenizer, [400])[400]
    _, chunks = bench.run_stateful(vocab, work, serialize=True)
    ours = bench.fold(chunks)
    theirs = bench.run_vllm(bench.default_vllm_python(), qwen3_tokenizer_dir, work, repeats=1)
    assert theirs["vllm_version"].startswith("0.32")
    assert bench.same_answer(ours, theirs["result"])
    assert theirs["result"]["finish_reason"] == "tool_calls"
