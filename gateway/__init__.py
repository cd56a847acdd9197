"""The API front door: requests in, render, route and engine choice, relay or derender, answers out.

    edge/       the HTTP edge: who is calling, whether they may, in what shape errors go back
    flow/       one request's way through: the pipeline, endpoint adapters, engine-less lookups, session keys
    routing/    where a request goes: the route and the engine
    upstream/   talking to engines and vLLM's services
    relay/      an engine's answer turned into the client's bytes
    apis/       the Responses and Messages APIs as shapes of a chat completion, and their state
    render/     request → token IDs, locally
    observe/    spans, metrics, the outcome event
    serving/    the process: app wiring, its state, each model's runtime, workers, reloads
    config.py   the YAML config every package reads
"""
