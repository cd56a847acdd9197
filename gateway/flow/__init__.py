"""One request's way through: the pipeline, the endpoint adapters, answers without an engine, session keys.

- `pipeline`: the edge's `serve` and the whole flow of a request: checks, render, route, the answer's shape, aborts
- `endpoints`: per-endpoint adapters (chat, completions, the translated Responses and Messages)
- `lookups`: answers without an engine: stored responses, `input_tokens`, `count_tokens`
- `session`: one session key per request, from wherever the client put its conversation id
"""
