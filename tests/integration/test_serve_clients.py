"""`onehop serve` (the embedded hf engine on the tiny random model) as the clients meet it:
the `openai` SDK's Responses API (streamed, not, and `parse()` with a pydantic model, which
the grammar makes valid whatever the random model prefers) and the `anthropic` SDK."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from engine.config import EngineConfig
from onehop.serve import embedded

# Each test starts `onehop serve`, the tiny model loaded with torch: kept out of the default
# suite, run by CI's `-m slow` stage.
pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=999)


async def test_responses_and_messages_against_serve(tiny_model_dir: Path) -> None:
    engine = EngineConfig(backend="hf", model=str(tiny_model_dir), backend_options={"threads": 1})
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            for route in ("derender", "text", "tokens"):
                headers = {"onehop-route": route}
                parsed = await client.responses.parse(
                    model=model, input="A city?", text_format=City, reasoning={"effort": "none"}, max_output_tokens=400,
                    extra_headers=headers, extra_body={"structured_outputs": {"disable_any_whitespace": True}},
                )
                assert isinstance(parsed.output_parsed, City), (route, parsed.output_text)
                events = [e async for e in await client.responses.create(
                    model=model, input="Hi", max_output_tokens=12, stream=True, extra_headers=headers)]
                final = events[-1]
                assert final.type == "response.incomplete" and final.response.usage is not None
                assert final.response.usage.output_tokens == 12
        sdk = anthropic.AsyncAnthropic(base_url=running.url, api_key="none", max_retries=0)
        try:
            answer = await sdk.messages.create(model=model, max_tokens=12, messages=[{"role": "user", "content": "Hi"}])
            assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 12
            async with sdk.messages.stream(model=model, max_tokens=12, messages=[{"role": "user", "content": "Hi"}]) as stream:
                streamed = await stream.get_final_message()
            assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 12
        finally:
            await sdk.close()


async def test_serve_on_the_simulator_without_a_served_name(qwen3_tokenizer_dir: Path) -> None:
    """`onehop serve --backend sim` as typed, no `--served-model-name`: the gateway and its
    engine agree on one name (the folder's), so it starts and answers under that name."""
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir))
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="derender") as running,
        openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client,
    ):
        assert [m.id for m in (await client.models.list()).data] == [qwen3_tokenizer_dir.name]
        answer = await client.chat.completions.create(
            model=qwen3_tokenizer_dir.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
