"""The wire contract the engine and the gateway share, and nothing else of either.

    protocol.py        the engine's generate and abort API (vLLM's wire, plus onehop's
                       `text` and `derender` output modes), encoded and decoded
    openai_schema.py   OpenAI's request and answer objects (chat, completions, errors)
    responses.py       OpenAI's Responses API, its answer side (items, usage, events)
    messages.py        Anthropic's Messages API, its answer side (blocks, usage, events, errors)
    grammar_limits.py  the bounds on a structured-output grammar, checked the same on both sides
    grammar_compile.py a grammar compiled (llguidance) to know it is one, before any engine runs it
"""
