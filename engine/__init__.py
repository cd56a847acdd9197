"""The generate server: `/inference/v1/generate` over a backend (transformers, a simulator,
vLLM), answering in token ids, text, or finished OpenAI objects (`output_mode`). It shares
only the wire contract (`wire`), the derender core (`derender`) and the process plumbing
(`plumbing`) with the gateway."""
