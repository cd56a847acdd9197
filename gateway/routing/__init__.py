"""Where a request goes: the route and the engine.

- `choose`: choosing the route and the engine (override header, policy, pools)
- `policy`: the route policy: rules and cost model (pure)
- `feedback`: engines' live load for the cost policy
"""
