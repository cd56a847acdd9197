"""The parity harness's own pieces, without vLLM: chunkings, the scheduler cut, compare, family tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from derender.vocab import TokenVocab
from engine.qwen3.vocab import ENDOFTEXT_ID, IM_END_ID, THINK_START_ID, TOTAL_VOCAB_SIZE
from tests.support.family_tokenizers import build_family_tokenizer, token_id
from tests.support.vllm_oracle import backend_output, chunkings, compare, id_shape, onehop_answer, onehop_full

CALL = '<think>\nok\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def answer(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"reasoning": "r", "content": None, "tool_calls": [], "finish_reason": "stop"}
    return {**base, **fields}


def case_for(tokenizer_dir: Path, output_ids: list[int], **extra: Any) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return {
        "tokenizer": str(tokenizer_dir),
        "tool_parser": "hermes",
        "reasoning_parser": "qwen3",
        "tools": tools,
        "prompt_token_ids": [],
        "output_token_ids": output_ids,
        **extra,
    }


def test_chunkings_cover_the_output_and_are_seeded() -> None:
    splits = chunkings(23, seed=4)
    assert [s[:3] for s in splits[:3]] == [[1, 1, 1], [2, 2, 2], [5, 5, 5]]
    assert len(splits) == 6 and all(sum(s) == 23 for s in splits)
    assert all(1 <= size <= 8 for s in splits[3:] for size in s)
    assert chunkings(23, seed=4) == splits != chunkings(23, seed=5)


def test_backend_cut_follows_vllm_eos_rules(qwen3_tokenizer_dir: Path) -> None:
    primary = backend_output(case_for(qwen3_tokenizer_dir, [1, IM_END_ID, 2]))
    assert (primary.token_ids, primary.finish_reason, primary.stop_reason) == ([1, IM_END_ID], "stop", None)
    other = backend_output(case_for(qwen3_tokenizer_dir, [1, ENDOFTEXT_ID]))
    assert (other.finish_reason, other.stop_reason) == ("stop", ENDOFTEXT_ID)
    ignored = backend_output(case_for(qwen3_tokenizer_dir, [1, IM_END_ID], request={"ignore_eos": True}))
    assert (ignored.token_ids, ignored.finish_reason) == ([1, IM_END_ID], "length")


def test_compare_reports_each_field() -> None:
    call = {"id": "chatcmpl-tool-ab12", "name": "f", "arguments": '{"a": 1}', "header_deltas": 1}
    assert not compare(answer(tool_calls=[call]), answer(content="", tool_calls=[{**call, "id": "chatcmpl-tool-ff"}]))
    other = {**call, "id": "functions.f:0", "arguments": '{"a": 2}', "header_deltas": 2}
    diffs = compare(answer(tool_calls=[call]), answer(reasoning="x", finish_reason="tool_calls", tool_calls=[other]))
    assert [d.split(":")[0].split(" ")[0] for d in diffs] == [
        "reasoning",
        "finish_reason",
        "tool_calls[0]",
        "tool_calls[0].arguments",
        "tool_calls[0].id",
    ]
    cut = {**call, "arguments": '{"a": '}
    assert compare(answer(tool_calls=[cut]), answer(tool_calls=[cut])) != []
    assert not compare(answer(tool_calls=[cut]), answer(tool_calls=[cut]), json_arguments=False)
    assert compare(answer(), {"error": "boom"}) == ["vLLM: boom"]
    assert (id_shape("chatcmpl-tool-ab12"), id_shape("functions.f:0")) == ("chatcmpl-tool", "functions.f:0")


def test_onehop_stream_and_full_fold_to_one_answer(
    qwen3_tokenizer: Any, qwen3_vocab: TokenVocab, qwen3_tokenizer_dir: Path
) -> None:
    case = case_for(qwen3_tokenizer_dir, [*qwen3_tokenizer.encode(CALL), IM_END_ID])
    full = onehop_full(qwen3_vocab, case)
    assert full["reasoning"] == "\nok\n" and full["finish_reason"] == "tool_calls"
    assert json.loads(full["tool_calls"][0]["arguments"]) == {"a": 1}
    for sizes in chunkings(len(case["output_token_ids"]), seed=1):
        assert not compare(onehop_answer(qwen3_vocab, case, sizes), full, reasoning_tokens=True)


def test_family_tokenizer_adds_single_tokens(qwen3_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    begin, eos = "<｜tool▁calls▁begin｜>", "<｜end▁of▁sentence｜>"
    added = [(begin, False), ("<think>", False), (eos, True)]
    root = qwen3_tokenizer_dir.parent
    folder = build_family_tokenizer(root, "test-family", added, eos=eos)
    assert build_family_tokenizer(root, "test-family", added, eos=eos) == folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = {content: token_id(folder, content) for content, _ in added}
    assert ids == {begin: TOTAL_VOCAB_SIZE, "<think>": THINK_START_ID, eos: TOTAL_VOCAB_SIZE + 1}
    for content, token in ids.items():
        assert tokenizer.encode(f"a {content} b")[2] == token
    assert tokenizer.eos_token_id == ids[eos]
    generation = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [ids[eos]]
    assert tokenizer.decode(list(ids.values()), skip_special_tokens=True) == f"{begin}<think>"
    with pytest.raises(ValueError, match="eos"):
        build_family_tokenizer(root, "test-family", added, eos="<missing>")
