"""The Responses and Messages APIs as other shapes of a chat completion, and their state.

- `responses`: the Responses API: request → chat request, chat answer → its events and objects
- `responses_input`: Responses input items as chat messages
- `messages`: Anthropic's Messages API: request → chat request, chat answer → its events and objects
- `translate`: the translated request and the presenter interface
- `agent_tools`: Responses tools as chat tools, and the model's calls back as their items
- `anthropic_tools`: Anthropic's typed tools (client tools' schemas, server tools' labels)
- `context_edits`: Anthropic's `context_management` edits, applied before render
- `response_store`: stored Responses, scoped per caller and bounded; the async interface requests use
- `shared_responses`: the Responses store that `--workers N` share (SQLite), and the choice of store (`state:`)
- `redis_responses`: the Responses store in a Redis server that replicas share (`state.backend: redis`)
"""
