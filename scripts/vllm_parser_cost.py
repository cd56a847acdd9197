"""CPU per output token of vLLM 0.32's own detokenize + parse for one parser family.

Run with the vLLM venv's python, never the project's::

    "$VLLM_PY" scripts/vllm_parser_cost.py CASES.json > RESULTS.json

CASES.json is a list of oracle cases (see ``scripts/vllm_parse_oracle.py``),
each with ``"repeats"``; the stream is fed one token per chunk as the coupled
chat server sees it: ``IncrementalDetokenizer.update([id])`` +
``get_next_output_text`` + one ``parser.parse_delta`` per token, timed with
``time.thread_time`` around the per-token loop only (parser and detokenizer
construction are outside, as onehop's side times them). RESULTS.json holds
``{"cpu_s": best of repeats, "tokens": n, "vllm_version": ...}`` per case.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

# Sibling scripts are imported as scripts.NAME, from the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.vllm_parse_oracle import Case, build_env, engine_request, make_parser


def cost(raw: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    case = Case.from_json(raw)
    env = build_env(case, stream=True)
    ids = env.token_ids
    best = float("inf")
    for _ in range(max(1, int(raw.get("repeats", 3)))):
        detok = IncrementalDetokenizer.from_new_request(env.tokenizer, engine_request(env))
        parser = make_parser(env, env.chat_template_kwargs)
        prompt, request, last = list(case.prompt_token_ids), env.request, len(ids) - 1
        gc.collect()
        start = time.thread_time()
        for i, token_id in enumerate(ids):  # hot loop: what the server does per token
            finished = i == last
            detok.update([token_id], finished and env.finish_reason == "stop")
            text = detok.get_next_output_text(finished, True)
            parser.parse_delta(
                delta_text=text, delta_token_ids=[token_id], request=request, prompt_token_ids=prompt, finished=finished
            )
        best = min(best, time.thread_time() - start)
    return {"cpu_s": best, "tokens": len(ids)}


def main(argv: list[str]) -> int:
    import vllm

    cases = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out = sys.stdout
    sys.stdout = sys.stderr  # anything vLLM prints must not land in the JSON
    try:
        results = [{**cost(raw), "vllm_version": vllm.__version__} for raw in cases]
    finally:
        sys.stdout = out
    json.dump(results, out)
    out.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
