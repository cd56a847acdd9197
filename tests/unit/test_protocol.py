"""wire/protocol.py and wire/openai_schema.py against hand-written vLLM 0.32-shaped JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from wire import openai_schema as oa
from wire import protocol as p

# ------------------------------------------------------------ samples

TOKENS_REQUEST = b"""{
  "request_id": "req-1",
  "token_ids": [151644, 872, 198, 9707, 151645],
  "sampling_params": {"temperature": 0.0, "max_tokens": 8, "stop_token_ids": [151645]},
  "model": "qwen3",
  "stream": false
}"""

# What vLLM's /v1/chat/completions/render returns: its SamplingParams as
# msgspec serialises it after __post_init__ (lists instead of nulls, derived
# fields) and every GenerateRequest field, nulls included.
RENDERED_REQUEST = b"""{
  "request_id": "r-2",
  "token_ids": [1, 2, 3],
  "token_offsets": null,
  "features": null,
  "content_parts": null,
  "sampling_params": {
    "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7,
    "stop": ["</s>"], "stop_token_ids": [], "max_tokens": 32, "logprobs": 5,
    "output_kind": 1, "skip_clone": true, "output_text_buffer_length": 3,
    "bad_words": [], "skip_reading_prefix_cache": false,
    "logit_bias": {"12": 1.5}, "extra_args": {"kv_transfer_params": {"a": 1}},
    "structured_outputs": {"json": {"type": "object"}},
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3}
  },
  "model": "qwen3",
  "reasoning_ended": null,
  "reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": false}},
  "return_token_ids": true,
  "output_mode": "tokens",
  "stream": true,
  "stream_options": {"include_usage": true, "continuous_usage_stats": false},
  "cache_salt": "c2FsdA",
  "priority": -3,
  "kv_transfer_params": {"do_remote_prefill": true},
  "ec_transfer_params": null
}"""

TEXT_REQUEST = b"""{
  "token_ids": [9707, 11],
  "sampling_params": {"max_tokens": 4, "stop": ["\\n\\n"], "logprobs": 2},
  "output_mode": "text",
  "stream": true,
  "stream_options": {"include_usage": true}
}"""

CHAT_REQUEST = {
    "model": "qwen3",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18C"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 64,
    "chat_template_kwargs": {"enable_thinking": True},
    "metadata": {"sent by": "a client, unknown to vLLM"},
}


def derender_body(**overrides: object) -> bytes:
    body: dict[str, object] = {
        "token_ids": [151644, 872],
        "sampling_params": {"max_tokens": 64},
        "output_mode": "derender",
        "stream": True,
        "chat_request": CHAT_REQUEST,
    }
    body.update(overrides)
    return json.dumps(body).encode()


# One choice per SSE event; vLLM writes its nulls. Token chunks leave out
# prompt_token_ids/metrics when null, the usage chunk drops every null.
TOKENS_CHUNKS = [
    b'{"request_id":"r","usage":null,"prompt_token_ids":[1,2,3],"output_mode":"tokens",'
    b'"choices":[{"index":0,"finish_reason":null,"stop_reason":null,"token_ids":[9707],'
    b'"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}',
    b'{"request_id":"r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
    b'"finish_reason":"stop","stop_reason":null,"token_ids":[151645],"routed_experts":null,'
    b'"sampling_mask":null,"weight_versions":null,"logprobs":{"content":[{"token_id":151645,'
    b'"logprob":-0.01,"rank":1,"top_logprobs":[{"token_id":151645,"logprob":-0.01,"rank":1},'
    b'{"token_id":13,"logprob":-4.5,"rank":2}]}]}}]}',
    b'{"request_id":"r","usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},'
    b'"output_mode":"tokens","choices":[]}',
]

TEXT_CHUNKS = [
    b'{"request_id":"r","usage":null,"output_mode":"text","choices":[{"index":0,'
    b'"finish_reason":null,"stop_reason":null,"token_ids":[9707],"routed_experts":null,'
    b'"sampling_mask":null,"weight_versions":null,"text":"Hello","logprobs":{"content":'
    b'[{"token":"Hello","logprob":-0.2,"bytes":[72,101,108,108,111],"top_logprobs":'
    b'[{"token":"Hello","logprob":-0.2,"bytes":[72,101,108,108,111]}]}]}}]}',
    # Text held back for stop-string matching, flushed at finish with no new ids.
    b'{"request_id":"r","usage":null,"output_mode":"text","choices":[{"index":0,'
    b'"finish_reason":"stop","stop_reason":"\\n\\n","token_ids":[],"routed_experts":null,'
    b'"sampling_mask":null,"weight_versions":null,"text":" world","logprobs":null}]}',
    # Only a finish_reason (an abort).
    b'{"request_id":"r","output_mode":"text","choices":[{"index":1,"finish_reason":"abort",'
    b'"token_ids":[],"text":""}]}',
    # Text with no token_ids key at all, as onehop's engine encodes a flush.
    b'{"request_id":"r","output_mode":"text","choices":[{"index":0,"text":"!"}]}',
]

TOKENS_RESPONSE = b"""{
  "request_id": "r", "model": "qwen3", "created": 1760000000,
  "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": null},
  "prompt_logprobs": null, "prompt_token_id_logprobs": null, "prompt_token_ids": null,
  "mm_placeholders": null, "metrics": null, "kv_transfer_params": null,
  "ec_transfer_params": null, "output_mode": "tokens",
  "choices": [{"index": 0, "finish_reason": "length", "stop_reason": null,
               "token_ids": [9707, 11], "routed_experts": null, "sampling_mask": null,
               "weight_versions": [{"version": "v1", "start": 0, "end": 2}],
               "logprobs": null}]
}"""

TEXT_RESPONSE = b"""{
  "request_id": "r", "model": "qwen3", "created": 1760000000,
  "usage": {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3},
  "prompt_logprobs": [null, {"9707": {"logprob": -1.5, "rank": 3, "decoded_token": "Hello"}}],
  "output_mode": "text",
  "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "!", "token_ids": [9707, 0, 0],
               "text": "Hello", "logprobs": {"content": [
                 {"token": "Hello", "logprob": -0.1, "bytes": [72, 101, 108, 108, 111],
                  "top_logprobs": []}]}}]
}"""

ERROR_BODY = (
    b'{"error":{"message":"Internal server error","type":"InternalServerError",'
    b'"param":null,"code":500}}'
)


# ------------------------------------------------------------ requests


def test_tokens_request_without_output_mode_means_tokens() -> None:
    req = p.decode_generate_request(TOKENS_REQUEST)
    assert req.output_mode == "tokens"
    assert req.token_ids == [151644, 872, 198, 9707, 151645]
    assert req.sampling_params.temperature == 0.0
    assert req.sampling_params.stop_token_ids == [151645]
    assert req.chat_request is None and req.completion_request is None


def test_defaults_are_vllms() -> None:
    req = p.decode_generate_request(b'{"token_ids": [5], "sampling_params": {}}')
    sp = req.sampling_params
    assert sp.max_tokens == 16
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert sp.logprobs is None and sp.detokenize is True and sp.skip_special_tokens is True
    assert req.stream is False and req.priority == 0 and req.output_mode == "tokens"
    assert len(req.request_id) == 32 and int(req.request_id, 16) >= 0
    other = p.decode_generate_request(b'{"token_ids": [5], "sampling_params": {}}')
    assert other.request_id != req.request_id


def test_rendered_request_from_vllm_decodes() -> None:
    req = p.decode_generate_request(RENDERED_REQUEST)
    sp = req.sampling_params
    assert sp.n == 2 and sp.stop == ["</s>"] and sp.logprobs == 5 and sp.output_kind == 1
    assert sp.logit_bias == {12: 1.5}
    assert sp.repetition_detection == oa.RepetitionDetectionParams(4, 0, 3)
    assert sp.structured_outputs == p.StructuredOutputs(json={"type": "object"})
    assert sp.structured_outputs.kind == "json"
    assert req.reasoning_parser_kwargs is not None
    assert req.reasoning_parser_kwargs.chat_template_kwargs == {"enable_thinking": False}
    assert req.stream_options == oa.StreamOptions(include_usage=True)
    assert (req.cache_salt, req.priority, req.return_token_ids) == ("c2FsdA", -3, True)
    assert req.kv_transfer_params == {"do_remote_prefill": True}


def test_text_request() -> None:
    req = p.decode_generate_request(TEXT_REQUEST)
    assert req.output_mode == "text" and req.stream is True
    assert req.sampling_params.stop == ["\n\n"] and req.sampling_params.logprobs == 2


def test_derender_request_carries_the_chat_request() -> None:
    req = p.decode_generate_request(derender_body())
    assert req.output_mode == "derender"
    chat = req.chat_request
    assert chat is not None and chat.model == "qwen3" and chat.max_completion_tokens == 64
    assert chat.effective_tool_choice() == "auto"
    assistant = chat.messages[2]
    assert assistant.reasoning == "Need the tool."  # folded, as vLLM does
    assert assistant.reasoning_content is msgspec.UNSET
    assert assistant.tool_calls and assistant.tool_calls[0].function.name == "get_weather"
    assert chat.messages[1].content == [oa.ChatContentPart(type="text", text="Weather in Paris?")]
    assert chat.messages[3].tool_call_id == "chatcmpl-tool-1"
    assert chat.messages[0].name is msgspec.UNSET


def test_derender_request_with_a_completion_request() -> None:
    body = derender_body(
        chat_request=None,
        stream=False,
        prompt_index=1,
        completion_request={"model": "qwen3", "prompt": ["a", "b"], "n": 2, "echo": True},
    )
    req = p.decode_generate_request(body)
    assert req.completion_request is not None
    assert req.completion_request.prompt == ["a", "b"] and req.prompt_index == 1


@pytest.mark.parametrize(
    "raw",
    [TOKENS_REQUEST, RENDERED_REQUEST, TEXT_REQUEST, derender_body()],
    ids=["tokens", "rendered", "text", "derender"],
)
def test_request_round_trip(raw: bytes) -> None:
    req = p.decode_generate_request(raw)
    again = p.decode_generate_request(p.encode(req))
    assert again == req


def test_encoded_request_omits_defaults() -> None:
    req = p.GenerateRequest(
        request_id="x", token_ids=[1], sampling_params=p.SamplingParams(max_tokens=3)
    )
    assert json.loads(p.encode(req)) == {
        "request_id": "x",
        "token_ids": [1],
        "sampling_params": {"max_tokens": 3},
    }


def _generate(**fields: object) -> bytes:
    body: dict[str, object] = {"token_ids": [1, 2], "sampling_params": {}}
    body.update(fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_generate(token_ids=[]), "length >= 1"),
        (_generate(token_ids=[1, -2]), "$.token_ids[1]"),
        (_generate(token_ids="12"), "$.token_ids"),
        (
            _generate(output_mode="text", sampling_params={"detokenize": False}),
            "requires sampling_params.detokenize",
        ),
        (
            _generate(output_mode="derender", sampling_params={"detokenize": False}),
            "requires sampling_params.detokenize",
        ),
        # Without an OpenAI request it is vLLM 0.33's form, which is never streamed.
        (_generate(output_mode="derender", stream=True), "does not support stream=true"),
        (
            _generate(
                output_mode="derender",
                chat_request={"messages": []},
                completion_request={"prompt": "x"},
            ),
            "exactly one",
        ),
        (_generate(chat_request={"messages": []}), "need output_mode='derender'"),
        (
            _generate(output_mode="derender", stream=True, chat_request={"messages": []}),
            "stream must match",
        ),
        (_generate(output_mode="detokenized"), "$.output_mode"),
        (_generate(cache_salt=""), "$.cache_salt"),
        (_generate(cache_salt="a" * 129), "$.cache_salt"),
        (_generate(cache_salt="tenant/42"), "cache_salt must not contain"),
        (_generate(features={"mm_hashes": {}}, content_parts=[{"type": "text"}]), "exclusive"),
        (_generate(sampling_params={"max_tokns": 5}), "unknown field `max_tokns`"),
        (_generate(sampling_params={"max_tokens": 0}), "$.sampling_params.max_tokens"),
        (_generate(sampling_params={"temperature": 2.5}), "$.sampling_params.temperature"),
        (_generate(sampling_params={"top_p": 0}), "$.sampling_params.top_p"),
        (_generate(sampling_params={"min_tokens": 17}), "min_tokens must be at most"),
        (_generate(sampling_params={"stop": ["ok", ""]}), "empty string"),
        (
            _generate(sampling_params={"stop": "x", "detokenize": False}),
            "need sampling_params.detokenize",
        ),
        (_generate(sampling_params={"logprobs": -2}), "$.sampling_params.logprobs"),
        (_generate(surprise=1), "unknown field `surprise`"),
        (b"{not json", "invalid generate request"),
    ],
)
def test_invalid_requests_raise_protocol_error(body: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_generate_request(body)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_cross_field_rules_hold_for_constructed_requests() -> None:
    with pytest.raises(p.ProtocolError, match="detokenize"):
        p.GenerateRequest(
            token_ids=[1],
            sampling_params=p.SamplingParams(detokenize=False),
            output_mode="text",
        )
    with pytest.raises(p.ProtocolError, match="min_tokens"):
        p.SamplingParams(max_tokens=2, min_tokens=3)


def test_null_features_count_as_absent() -> None:
    req = p.decode_generate_request(_generate(features=None, content_parts=[{"type": "text"}]))
    assert req.content_parts is not None and len(req.content_parts) == 1


def test_request_view_reads_routing_fields_only() -> None:
    view = p.decode_generate_request_view(RENDERED_REQUEST)
    assert (view.output_mode, view.stream, view.model, view.request_id) == (
        "tokens",
        True,
        "qwen3",
        "r-2",
    )
    assert (view.sampling_params.n, view.sampling_params.logprobs) == (2, 5)
    bare = p.decode_generate_request_view(b'{"token_ids":[1],"sampling_params":{}}')
    assert (bare.output_mode, bare.sampling_params.n, bare.request_id) == ("tokens", 1, None)


def test_sampling_params_sent_keys() -> None:
    assert p.sampling_params_sent_keys(TOKENS_REQUEST) == {
        "temperature",
        "max_tokens",
        "stop_token_ids",
    }
    assert p.sampling_params_sent_keys(b'{"token_ids":[1]}') == frozenset()


def test_abort_request() -> None:
    assert p.decode_abort_request(b'{"request_ids": ["a", "b"]}').request_ids == ["a", "b"]
    assert p.encode(p.AbortRequest(["a"])) == b'{"request_ids":["a"]}'
    with pytest.raises(p.ProtocolError, match="request_ids"):
        p.decode_abort_request(b"{}")


# ------------------------------------------------------------ responses


@pytest.mark.parametrize("mode", [None, "tokens"])
def test_tokens_stream_chunks(mode: p.OutputMode | None) -> None:
    first, last, usage = (p.decode_generate_stream_chunk(c, mode) for c in TOKENS_CHUNKS)
    assert isinstance(first, p.GenerateTokensStreamResponse)
    assert first.prompt_token_ids == [1, 2, 3]
    assert first.choices[0].token_ids == [9707] and first.choices[0].finish_reason is None
    assert isinstance(last, p.GenerateTokensStreamResponse)
    logprobs = last.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    entry = logprobs.content[0]
    assert (entry.token_id, entry.rank) == (151645, 1)
    assert [c.token_id for c in entry.top_logprobs] == [151645, 13]  # sampled first
    assert isinstance(usage, p.GenerateTokensStreamResponse)
    assert usage.choices == [] and usage.usage == oa.Usage(3, 5, 2)


@pytest.mark.parametrize("mode", [None, "text"])
def test_text_stream_chunks(mode: p.OutputMode | None) -> None:
    first, flush, finish, bare = (p.decode_generate_stream_chunk(c, mode) for c in TEXT_CHUNKS)
    assert isinstance(first, p.GenerateTextStreamResponse)
    choice = first.choices[0]
    assert choice.text == "Hello" and choice.logprobs is not None
    assert choice.logprobs.content is not None
    assert choice.logprobs.content[0].bytes == list(b"Hello")
    assert isinstance(flush, p.GenerateTextStreamResponse)
    assert flush.choices[0].text == " world" and flush.choices[0].token_ids == []
    assert flush.choices[0].stop_reason == "\n\n"
    assert isinstance(finish, p.GenerateTextStreamResponse)
    assert finish.choices[0].finish_reason == "abort" and finish.choices[0].index == 1
    assert isinstance(bare, p.GenerateTextStreamResponse)
    assert bare.choices[0].text == "!" and bare.choices[0].token_ids is None


def test_chunk_without_output_mode_is_tokens() -> None:
    raw = b'{"request_id":"r","choices":[{"index":0,"token_ids":[3]}]}'
    for mode in (None, "tokens"):
        chunk = p.decode_generate_stream_chunk(raw, mode)
        assert isinstance(chunk, p.GenerateTokensStreamResponse)
        assert chunk.output_mode == "tokens"
    response = p.decode_generate_response(b'{"choices":[{"index":0,"token_ids":[3]}]}')
    assert isinstance(response, p.GenerateTokensResponse)
    assert response.choices[0].finish_reason == "stop"  # vLLM's default


def test_chunk_of_another_mode_is_refused() -> None:
    with pytest.raises(p.ProtocolError, match="output_mode"):
        p.decode_generate_stream_chunk(TEXT_CHUNKS[0], "tokens")
    with pytest.raises(p.ProtocolError, match="output_mode"):
        p.decode_generate_stream_chunk(TOKENS_CHUNKS[0], "text")
    untagged = b'{"request_id":"r","choices":[{"index":0,"token_ids":[3]}]}'
    with pytest.raises(p.ProtocolError, match="missing required field `text`"):
        p.decode_generate_stream_chunk(untagged, "text")
    with pytest.raises(p.ProtocolError, match="unknown output_mode"):
        p.decode_generate_stream_chunk(b'{"output_mode":"bits","choices":[]}')


@pytest.mark.parametrize("mode", [None, "tokens", "text", "derender"])
def test_error_body_raises_engine_error(mode: p.OutputMode | None) -> None:
    with pytest.raises(p.EngineError, match="Internal server error") as info:
        p.decode_generate_stream_chunk(ERROR_BODY, mode)
    assert info.value.info.code == 500
    with pytest.raises(p.EngineError):
        p.decode_generate_response(ERROR_BODY, mode)


def test_tokens_response() -> None:
    response = p.decode_generate_response(TOKENS_RESPONSE)
    assert isinstance(response, p.GenerateTokensResponse)
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 4
    choice = response.choices[0]
    assert (choice.finish_reason, choice.token_ids) == ("length", [9707, 11])
    assert choice.weight_versions == [p.WeightVersionSpan("v1", 0, 2)]
    assert p.decode_generate_response(TOKENS_RESPONSE, "tokens") == response


def test_text_response_keeps_every_token_id() -> None:
    response = p.decode_generate_response(TEXT_RESPONSE, "text")
    assert isinstance(response, p.GenerateTextResponse)
    choice = response.choices[0]
    assert choice.text == "Hello" and choice.token_ids == [9707, 0, 0]
    assert response.prompt_logprobs is not None
    assert response.prompt_logprobs[1] == {9707: oa.PromptLogprob(-1.5, 3, "Hello")}


@pytest.mark.parametrize("raw", [TOKENS_RESPONSE, TEXT_RESPONSE])
def test_response_round_trip(raw: bytes) -> None:
    response = p.decode_generate_response(raw)
    assert p.decode_generate_response(p.encode(response)) == response


@pytest.mark.parametrize("raw", TOKENS_CHUNKS + TEXT_CHUNKS)
def test_chunk_round_trip(raw: bytes) -> None:
    chunk = p.decode_generate_stream_chunk(raw)
    assert p.decode_generate_stream_chunk(p.encode(chunk)) == chunk


def test_stream_chunks_encode_small_and_keep_their_mode() -> None:
    chunk = p.GenerateTextStreamResponse(
        request_id="r", choices=[p.GenerateTextStreamChoice(index=0, text="", token_ids=[])]
    )
    assert p.encode(chunk) == (
        b'{"output_mode":"text","request_id":"r","choices":[{"index":0,"token_ids":[],"text":""}]}'
    )
    tokens = p.GenerateTokensStreamResponse(request_id="r", choices=[])
    assert json.loads(p.encode(tokens))["output_mode"] == "tokens"


def test_full_responses_encode_every_field_like_vllm() -> None:
    response = p.GenerateTokensResponse(
        request_id="r", choices=[p.GenerateTokensChoice(index=0, token_ids=[1])]
    )
    body = json.loads(p.encode(response))
    assert body["output_mode"] == "tokens" and body["usage"] is None
    assert body["choices"][0] == {
        "index": 0,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": [1],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
        "logprobs": None,
    }


def test_derender_answers_decode_by_object() -> None:
    chat = oa.ChatCompletion(
        id="chatcmpl-r",
        created=1,
        model="qwen3",
        choices=[oa.ChatCompletionChoice(index=0, message=oa.ChatCompletionMessage(content="hi"))],
        usage=oa.Usage(3, 4, 1),
    )
    assert p.decode_generate_response(p.encode(chat)) == chat
    assert p.decode_generate_response(p.encode(chat), "derender") == chat
    chunk = oa.ChatCompletionChunk(
        id="chatcmpl-r",
        created=1,
        model="qwen3",
        choices=[oa.ChatCompletionChunkChoice(index=0, delta=oa.ChatDelta(content="h"))],
    )
    assert p.decode_generate_stream_chunk(p.encode(chunk), "derender") == chunk
    text = oa.CompletionChunk(
        id="cmpl-r", created=1, model="q", choices=[oa.CompletionChunkChoice(index=2, text="x")]
    )
    assert p.decode_generate_stream_chunk(p.encode(text)) == text
    completion = oa.Completion(
        id="cmpl-r",
        created=1,
        model="q",
        choices=[oa.CompletionChoice(index=0, text="x")],
        usage=oa.Usage(),
    )
    assert p.decode_generate_response(p.encode(completion)) == completion
    with pytest.raises(p.ProtocolError, match="OpenAI object"):
        p.decode_generate_stream_chunk(TOKENS_CHUNKS[0], "derender")


# ------------------------------------------------------------ OpenAI shapes


def test_chat_request_accepts_unknown_fields_and_keeps_vllm_defaults() -> None:
    chat = oa.CHAT_COMPLETION_REQUEST_DECODER.decode(json.dumps(CHAT_REQUEST).encode())
    assert chat.include_reasoning is True and chat.add_generation_prompt is True
    assert chat.logprobs is False and chat.top_logprobs == 0 and chat.n == 1
    assert chat.stop == [] and chat.skip_special_tokens is True
    bare = oa.CHAT_COMPLETION_REQUEST_DECODER.decode(
        b'{"messages":[{"role":"user","content":"x"}]}'
    )
    assert bare.effective_tool_choice() == "none" and bare.max_tokens is None
    named = oa.CHAT_COMPLETION_REQUEST_DECODER.decode(
        b'{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}],'
        b'"tool_choice":{"type":"function","function":{"name":"f"}}}'
    )
    assert named.effective_tool_choice() == oa.NamedToolChoice(oa.NamedFunction("f"))


def test_chat_message_re_encodes_only_what_was_sent() -> None:
    chat = oa.CHAT_COMPLETION_REQUEST_DECODER.decode(json.dumps(CHAT_REQUEST).encode())
    messages = json.loads(oa.ENCODER.encode(chat.messages))
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["reasoning"] == "Need the tool." and "reasoning_content" not in messages[2]


@pytest.mark.parametrize(
    "prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=["str", "strs", "ids", "id-lists"]
)
def test_completion_prompt_forms(prompt: object) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": None}).encode()
    request = oa.COMPLETION_REQUEST_DECODER.decode(body)
    assert request.prompt == prompt and request.max_tokens == 16


def test_completion_prompt_must_be_one_kind() -> None:
    with pytest.raises(msgspec.ValidationError, match="not a mix"):
        oa.COMPLETION_REQUEST_DECODER.decode(b'{"prompt": ["a", 1]}')
    with pytest.raises(msgspec.ValidationError, match=r"\$\.prompt\[0\]"):
        oa.COMPLETION_REQUEST_DECODER.decode(b'{"prompt": [-1]}')


def test_first_chat_chunk_matches_vllm() -> None:
    chunk = oa.ChatCompletionChunk(
        id="chatcmpl-1",
        created=7,
        model="qwen3",
        choices=[
            oa.ChatCompletionChunkChoice(index=0, delta=oa.ChatDelta(role="assistant", content=""))
        ],
    )
    assert oa.ENCODER.encode(chunk) == (
        b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"qwen3",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}]}'
    )


def test_tool_call_delta_omits_unset_fields() -> None:
    delta = oa.ChatDelta(
        tool_calls=[oa.DeltaToolCall(index=0, function=oa.DeltaFunctionCall(arguments='{"a'))]
    )
    assert (
        oa.ENCODER.encode(delta) == b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"a"}}]}'
    )


def test_reasoning_alias_is_the_producers_choice() -> None:
    vllm_style = oa.ChatCompletionMessage(content="x", reasoning="why")
    assert json.loads(oa.ENCODER.encode(vllm_style)) == {
        "role": "assistant",
        "content": "x",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": "why",
    }
    alias_only = oa.ChatCompletionMessage(reasoning=msgspec.UNSET, reasoning_content="why")
    body = json.loads(oa.ENCODER.encode(alias_only))
    assert body["reasoning_content"] == "why" and "reasoning" not in body
    assert oa.ENCODER.encode(oa.ChatDelta(reasoning="a", reasoning_content="a")) == (
        b'{"reasoning":"a","reasoning_content":"a"}'
    )


def test_error_response_shape() -> None:
    error = oa.ErrorResponse(oa.ErrorInfo("bad", "BadRequestError", "temperature", 400))
    assert json.loads(oa.ENCODER.encode(error)) == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "temperature", "code": 400}
    }
    openai_style = oa.ERROR_RESPONSE_DECODER.decode(
        b'{"error":{"message":"m","type":"invalid_request_error","param":null,"code":"model_not_found"}}'
    )
    assert openai_style.error.code == "model_not_found"


def test_schema_modules_import_no_heavy_packages() -> None:
    code = (
        "import sys, wire.protocol, wire.openai_schema; "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_structured_outputs_take_exactly_one_constraint_and_vllms_own_fields() -> None:
    def sampling(constraint: object) -> bytes:
        return json.dumps({"token_ids": [5], "sampling_params": {"structured_outputs": constraint}}).encode()

    echoed = p.decode_generate_request(sampling({"choice": ["a", "b"], "_backend": "guidance", "_backend_was_auto": True}))
    constraint = echoed.sampling_params.structured_outputs
    assert constraint is not None and constraint.kind == "choice" and constraint.backend == "guidance"
    for wrong, words in (({}, "none are specified"), ({"regex": "a", "choice": ["a"]}, "multiple are specified"), ({"jsn": {}}, "jsn")):
        with pytest.raises(p.ProtocolError, match=words):
            p.decode_generate_request(sampling(wrong))
