"""Where a request goes: the route and the engine.

- `choose`: choosing the route and the engine (override header, policy, pools)
- `policy`: the route policy: rules and cost model (pure)
- `datastore`: what is known of each pool's engines (membership, capabilities, health,
  load, the KV index): fed by the background loops, read by the picker
- `picker`: which engine serves a request: filters, scorers, pick (pure)
- `feedback`: engines' metrics scraped into the datastore
- `kv_index`: which engine holds which prefix blocks, from their KV events
"""
