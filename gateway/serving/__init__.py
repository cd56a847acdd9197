"""The process: the app's wiring, its state, each model's runtime, workers, reloads.

- `app`: the aiohttp app: routes, middlewares, start and stop
- `state`: what the process holds: config, models by name, clients, keys, admission
- `runtime`: one model's immutable runtime: renderer, vocabulary, parsers, pools
- `workers`: `--workers N`: the supervisor of N processes on one port
- `worker_env`: the environment the supervisor hands each worker
- `supervisor`: background loops kept running
- `reload`: hot-reloaded files
- `memory`: start-up's freed heap handed back to the system
- `preflight`: the gateway's start-up checks
"""
