"""The HTTP edge: who is calling, whether they may, and in what shape errors go back.

- `auth`: API keys and the caller they name
- `admission`: at-most-N-at-once admission, a priority and fair queue (429s, 503s)
- `priority`: a request's priority, from its tenant and its ask
- `errors`: errors and their one mapping to OpenAI's error shape
- `access_log`: the access log: one line per request, without query strings
- `context`: the request's context: the frozen values the steps take instead of the aiohttp request, and its tally
- `validate`: refusing unsupported fields by name, and the operator's limits
- `unknown_fields`: top-level request fields the gateway does not know, on the APIs agents speak: ignored or refused
"""
