"""The process plumbing both servers share (the engine's and the gateway's).

    http_server.py   aiohttp's server, answering its own errors in the API's shape
    telemetry.py     OpenTelemetry tracing, one provider per app: trace context in and out
"""
