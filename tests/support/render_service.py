"""A scripted stand-in for vLLM's render service (`--enable-scale-out`): a real aiohttp app.

It answers vLLM 0.32's shapes (one GenerateRequest for chat, a list of them,
one per prompt, for completions), rendered with transformers'
`apply_chat_template` and the tokenizer directly, not with onehop's
renderer: a gateway with `render: remote` in front of it must give the
answers `render: local` gives. The real service is tested in
`tests/vllm/test_remote_services.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.typed import token_ids


@dataclass
class RenderCalls:
    chat: int = 0
    completions: int = 0
    prompts: list[list[int]] = field(default_factory=list)


def _generate_request(token_ids: list[int]) -> dict[str, Any]:
    return {"request_id": uuid.uuid4().hex, "token_ids": token_ids, "sampling_params": {"max_tokens": 16}, "stream": False}


@asynccontextmanager
async def render_service(tokenizer_dir: Path) -> AsyncIterator[tuple[str, RenderCalls]]:
    from transformers import AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    calls = RenderCalls()

    async def chat(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        kwargs = body.get("chat_template_kwargs") or {}
        encoded = tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True, **kwargs
        )
        # newer transformers: a BatchEncoding
        ids = token_ids(encoded["input_ids"] if isinstance(encoded, BatchEncoding) else encoded)
        calls.chat += 1
        calls.prompts.append(ids)
        return web.json_response(_generate_request(ids))

    async def completions(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        prompt = body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        rendered = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        calls.completions += 1
        calls.prompts.extend(rendered)
        return web.json_response([_generate_request(ids) for ids in rendered])

    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", chat)
    app.router.add_post("/v1/completions/render", completions)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), calls
    finally:
        await server.close()
