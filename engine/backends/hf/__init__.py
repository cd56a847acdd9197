"""The transformers backend: real generation with continuous batching on one KV cache.

One step of the data flow per module:

- `model`: the configuration (`HFBackendConfig`) and the model folder: what it serves, loading it;
- `plan`: a request's sampling params checked and resolved once, on arrival;
- `state`: a request's rows (one per choice), its outbox, and when a choice is done;
- `batch`: the running rows and their shared, left-padded KV cache;
- `sampling`: one token per row from the logits, with logprobs (the hot path);
- `backend`: `HFBackend`, its lifecycle, admission and the scheduler that drives each step.
"""

from engine.backends.hf.backend import HFBackend
from engine.backends.hf.model import HFBackendConfig

__all__ = ["HFBackend", "HFBackendConfig"]
