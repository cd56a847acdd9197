"""Structured outputs on the hf backend: what the grammar costs per token, llguidance against xgrammar.

Walks one valid instance of a nested pydantic schema through a matcher on the
Qwen3 vocabulary (151,669 tokens), masking the logits before each token as the
hf backend does, and prints per engine: the vocabulary table's build time, the
grammar's compile time and the mask cost per token (median of `--rounds`).
llguidance is measured through onehop's own `engine.backends.grammar`; xgrammar
only if it can be imported (it is not a dependency: it pulls triton,
apache-tvm-ffi and transformers; for a side-by-side run install it aside, e.g.
`pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi` and
`PYTHONPATH=/tmp/xgr`).

    .venv/bin/python scripts/bench_grammar.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from engine.backends.grammar import ChoiceGrammar, GrammarTokenizer  # noqa: E402
from wire.grammar_compile import compile_grammar  # noqa: E402
from wire.protocol import StructuredOutputs  # noqa: E402
from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]
    tags: list[str]
    home: Address
    nickname: str | None
    born: datetime


INSTANCE = Person(
    name="Ann Lee", age=31, role="admin", tags=["a", "bc"], home=Address(city="Paris", zip_code=75001),
    nickname=None, born=datetime(2020, 1, 1, tzinfo=UTC),
)


def bench_llguidance(tokenizer: Any, ids: list[int], eos: int) -> dict[str, float]:
    started = time.perf_counter()
    table = GrammarTokenizer(tokenizer, len(tokenizer))
    table.get()
    built = time.perf_counter()
    grammar = compile_grammar(StructuredOutputs(json=Person.model_json_schema()))
    choice = ChoiceGrammar(table, grammar, None)
    compiled = time.perf_counter()
    logits = torch.zeros(len(tokenizer))
    for token in ids:
        logits.zero_()  # fresh logits each step, as a forward pass gives
        choice.mask(logits)
        choice.accept(token)
    logits.zero_()
    choice.mask(logits)
    assert logits[eos] == 0, "EOS is not allowed after a complete instance"
    done = time.perf_counter()
    return {"table_ms": 1e3 * (built - started), "compile_ms": 1e3 * (compiled - built), "per_token_us": 1e6 * (done - compiled) / len(ids)}


def bench_xgrammar(tokenizer: Any, ids: list[int], eos: int) -> dict[str, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    built = time.perf_counter()
    compiled_grammar = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(Person.model_json_schema()))
    matcher = xgr.GrammarMatcher(compiled_grammar)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compiled = time.perf_counter()
    logits = torch.zeros(1, len(tokenizer))
    for token in ids:
        logits.zero_()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert matcher.accept_token(token)
    done = time.perf_counter()
    return {"table_ms": 1e3 * (built - started), "compile_ms": 1e3 * (compiled - built), "per_token_us": 1e6 * (done - compiled) / len(ids)}


def median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tokenizer())
    ids = tokenizer.encode(INSTANCE.model_dump_json(), add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(eos, int), eos
    results: dict[str, list[dict[str, float]]] = {"llguidance": [], "xgrammar": []}
    for _ in range(args.rounds):  # interleaved: both see the same machine load
        results["llguidance"].append(bench_llguidance(tokenizer, ids, eos))
        measured = bench_xgrammar(tokenizer, ids, eos)
        if measured is not None:
            results["xgrammar"].append(measured)
    print(f"{len(ids)} tokens per instance, vocabulary {len(tokenizer)}, {args.rounds} rounds (medians)")
    print("| grammar engine | vocabulary table (ms) | compile (ms) | mask per token (µs) |")
    print("|---|---:|---:|---:|")
    for name, rounds in results.items():
        if rounds:
            print(f"| {name} | {median(rounds, 'table_ms'):.0f} | {median(rounds, 'compile_ms'):.1f} | {median(rounds, 'per_token_us'):.0f} |")
        else:
            print(f"| {name} | not installed | | |")
    if results["xgrammar"]:
        ratio = median(results["llguidance"], "per_token_us") / median(results["xgrammar"], "per_token_us")
        print(f"llguidance / xgrammar mask cost per token: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
