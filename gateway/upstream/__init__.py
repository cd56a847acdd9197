"""Talking to engines and to vLLM's services.

- `engine_client`: engines' HTTP: timeouts, retries, capabilities checks, aborts, health
- `engine_stream`: streamed engine answers on the gateway's own HTTP/1.1 client
- `engine_request`: OpenAI request → the engine's generate body
- `kv_events`: subscribers to engines' KV cache events, feeding the KV index
- `disagg`: the prefill step of prefill/decode disaggregation
- `remote`: vLLM's render and stateless derender services
- `vllm_derender`: a stock vLLM ≥ 0.33's derender form and its answer as the client's completion
"""
