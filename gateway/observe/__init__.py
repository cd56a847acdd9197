"""Spans, metrics, and the one outcome event per request.

- `spans`: the outcome's trace subscriber: spans; stream timings
- `content`: the answer as GenAI's output messages, under `tracing.record_content`
- `metrics`: the outcome's Prometheus subscriber
- `outcome`: the one outcome event per API request and its subscribers
"""
