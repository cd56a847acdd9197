"""The `vllm` backend on the tiny Qwen3 model, driven in vLLM's venv by `run_vllm_backend.py`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import ROOT, server_env
from tests.vllm.run_vllm_backend import GREEDY_TOKENS, LONG_TOKENS, TOP_LOGPROBS

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("run_vllm_backend.py")
# Start (~20-45 s) plus a few short generations on two cores.
SCRIPT_TIMEOUT_S = 300
QWEN3_PADDED_VOCAB = 151_936
QWEN3_EOS = [151_643, 151_645]


@pytest.fixture(scope="module")
def report(vllm_python: Path, tiny_model_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(vllm_python), str(SCRIPT), str(tiny_model_dir)],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        pytest.fail(f"run_vllm_backend.py exited {done.returncode}:\n{out[-4000:]}\n{done.stderr.decode()[-6000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_info_is_vllms_view_of_the_model(report: dict[str, Any]) -> None:
    assert report["info"] == {
        "name": "vllm",
        "model": report["info"]["model"],
        "max_model_len": 2048,
        "vocab_size": QWEN3_PADDED_VOCAB,
        "eos_token_ids": QWEN3_EOS,
    }
    assert report["info"]["model"].endswith("qwen3-tiny-v1")


def test_greedy_generates_max_tokens_in_vocab(report: dict[str, Any]) -> None:
    (choice,) = report["greedy"]["choices"]
    assert len(choice["token_ids"]) == GREEDY_TOKENS
    assert all(0 <= t < QWEN3_PADDED_VOCAB for t in choice["token_ids"])
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert choice["logprobs"] == []
    assert "after_finish" not in choice
    # DELTA outputs: every step brings new tokens, none is repeated.
    assert 1 <= report["greedy"]["steps"] <= GREEDY_TOKENS


def test_greedy_is_repeatable(report: dict[str, Any]) -> None:
    assert report["greedy_again"]["choices"][0]["token_ids"] == report["greedy"]["choices"][0]["token_ids"]


def test_n2_with_logprobs_has_sampled_first_then_top_k(report: dict[str, Any]) -> None:
    choices = report["n2_logprobs"]["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert len(choice["token_ids"]) == GREEDY_TOKENS
        assert choice["finish_reason"] == "length"
        assert [e["token_id"] for e in choice["logprobs"]] == choice["token_ids"]
        for entry in choice["logprobs"]:
            _check_entry(entry)


def _check_entry(entry: dict[str, Any]) -> None:
    top = entry["top"]
    # vLLM's wire shape: the sampled token leads, then the top-k by rank, cut to k entries.
    assert len(top) == TOP_LOGPROBS
    assert top[0] == [entry["token_id"], entry["logprob"], entry["rank"]]
    assert entry["rank"] >= 1 and entry["logprob"] <= 0.0
    ranks = [rank for _, _, rank in top[1:]]
    assert ranks == sorted(ranks) and all(rank >= 1 for rank in ranks)
    assert len({token for token, _, _ in top}) == len(top)
    others = [logprob for _, logprob, _ in top[1:]]
    assert others == sorted(others, reverse=True)


def test_greedy_with_n_above_one_is_refused(report: dict[str, Any]) -> None:
    assert report["refused_greedy_n2"] == "BackendRequestError"


def test_closing_the_stream_aborts_the_request(report: dict[str, Any]) -> None:
    closed = report["abort_by_close"]
    assert closed["running_during"] == ["close-me"]
    assert closed["running_after"] == []
    assert closed["vllm_unfinished_s"] is not None, "vLLM still had the request after the stream closed"


def test_abort_by_id_finishes_every_choice_with_abort(report: dict[str, Any]) -> None:
    aborted = report["abort_by_id"]
    assert aborted["finishes"] == ["abort", "abort"]
    assert aborted["running_after"] == []
    assert aborted["tokens"] < 2 * LONG_TOKENS


def test_bad_prompts_are_request_errors(report: dict[str, Any]) -> None:
    assert report["refused_out_of_vocab"] == "BackendRequestError"
    assert report["refused_too_long"] == "BackendRequestError"


def test_nothing_left_running(report: dict[str, Any]) -> None:
    assert report["running_at_end"] == []
