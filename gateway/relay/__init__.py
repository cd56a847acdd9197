"""An engine's answer turned into the client's bytes.

- `engine`: the engine side of an answer: reads under their deadlines, SSE checks, the gateway's derender
- `routes`: one object per route: each leg's client stream, whole answer, and chunks
- `responder`: the client side of an answer: the one stream responder and the client's stream
- `splice`: after the client's first byte, engine pieces written to the client in the socket's callback
- `sse`: SSE framing
- `client_watch`: whether a streaming client takes what it is sent, measured at its socket
"""
