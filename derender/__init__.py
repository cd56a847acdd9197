"""The derender core: engine output (token ids or text) → OpenAI answers, statefully, O(delta).

One derender per request keeps each choice's state (detokenizer, stop strings, the
reasoning and tool-call parsers of the model's family), so each step costs what its new
tokens cost, never a replay of what came before. The engine runs it for the `derender`
output mode (with `present`, in the Responses or Messages shape); the gateway runs the
same code on the `text` and `tokens` routes.

    chat.py, completion.py   the chat and completions derenders (their chunks and answers)
    responses.py             chat's parsed chunks as OpenAI's Responses events, or a Response
    messages.py              chat's parsed chunks as Anthropic's Messages events, or a Message
    custom_input.py          a custom tool call's free text, whole or as it streams
    text.py, detokenizer.py  token ids → released text, incrementally, with stop strings
    stop.py                  stop strings over a stream of decoded pieces
    markers.py               markers found in text that arrives without token boundaries
    logprobs.py, usage.py    logprobs and usage in OpenAI's shapes
    toolcall.py              an incremental reader of one Hermes tool-call body
    vocab.py                 per-token decode tables, built once per tokenizer
    errors.py                what the derender raises for output that breaks the protocol
    parsers/                 the reasoning and tool-call parsers, one module per family
"""
