"""A deterministic simulator backend: a real tokenizer, no model.

For load tests and benchmarks of everything above the backend (engine server,
derender, gateway): the simulator answers `/inference/v1/generate` at a
configured pace with output in the format of the engine's reasoning and tool
parser families (Qwen3 `<think>` and Hermes calls unless told otherwise),
without a GPU or model weights.

Configuration (`SimBackendConfig`, decoded strictly: unknown keys are errors)::

    tokenizer           a Hugging Face tokenizer folder (its tokenizer.json)
    served_model_name   reported in BackendInfo.model ("sim")
    ttft_ms, itl_ms     time to first token, then time between steps (0, 0)
    tokens_per_step     tokens per step and choice, like speculative decoding (1)
    mode                "auto", "echo", "script" or "agent" ("auto")
    script              texts for mode "script"
    agent_calls         mode "agent": tool name -> the arguments to call it with,
                        tried in order ({}; the mode needs at least one)
    seed                mixed into every choice's random stream (0)
    max_model_len       prompt + output limit (32768)
    reasoning           auto mode thinks when the prompt leaves thinking open (true)
    output_tokens       auto mode content length in tokens; null: 16-64 words
    reasoning_format    the reasoning family written ("qwen3"; the engine's parser;
                        null: none, as for tool formats without reasoning)
    tool_format         the tool-call family written ("hermes"; the engine's parser)
    prefix_caching      keep prompts' full KV blocks and report hits (false; the
                        engine's --enable-prefix-caching)
    block_size          tokens per KV block (16; the engine's --block-size)
    cache_blocks        the cache's capacity in blocks (4096)
    prefill_us_per_token  prefill time per prompt token not cached (0); above 0, the
                        engine's prompts prefill one at a time (see Timing)
    kv_events           the engine's --kv-events-config (set by the engine)
    kv_events_encoding  "map" (vLLM's events since mid-2026) or "array" (before)

What each mode plans before the token rules below apply:

- ``echo``: the text of the last user turn of a ChatML prompt (between the
  last ``<|im_start|>user\\n`` and its ``<|im_end|>``; a turn of tool
  responses counts), or the whole prompt text when the prompt has no
  ``<|im_start|>``, re-encoded, then EOS.
- ``script``: the next text of ``script`` (the k-th request gets text
  ``k mod len(script)``; all choices of a request share it), encoded as is so
  it may carry ``<think>``/``<tool_call>`` markers, then EOS.
- ``agent``: one step of a coding agent's tool loop, for driving real agent
  clients (Codex CLI, Claude Code) through the gateway. Reasoning first when
  the prompt leaves thinking open (as in auto mode), then: when the last
  user turn holds tool results (``<tool_response>`` blocks, as the Qwen3
  template renders tool messages), the answer ``The command printed: `` and
  the results' text; else, when the ``<tools>`` block lists a tool named in
  ``agent_calls``, a call of the first such tool (in ``agent_calls``' order)
  with its configured arguments, in ``tool_format``'s format; else content as
  in auto mode. Answers and content are written as the tool format's family
  writes an answer (gpt-oss: a ``final`` channel message). Then EOS.
- ``auto``, in these parts, then EOS:

  1. Reasoning, when the prompt leaves thinking open (a ChatML prompt ending
     with ``<|im_start|>assistant\\n``; ``enable_thinking=false`` renders
     ``<think>\\n\\n</think>\\n\\n`` after it, which closes it):
     ``<think>\\n`` + 8-32 words + ``\\n</think>\\n\\n``. With
     ``reasoning=false`` the block is empty (``<think>\\n\\n</think>\\n\\n``),
     as Qwen3 writes it when told not to think, so parsers still see content.
  2. A tool call, when the system turn holds a ``<tools>`` block (one JSON
     tool per line, as the Qwen3 chat template renders them): one of the
     tools, chosen by the seed, called in ``tool_format``'s format (Hermes:
     ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``). The
     arguments follow the tool's JSON-schema ``parameters``: every required
     property and about half of the optional ones; ``const``/``enum`` give
     their (first) value, ``anyOf``/``oneOf`` their first option, strings
     are 1-3 words, integers and numbers seeded within
     ``minimum``/``maximum`` (0-100 otherwise), booleans seeded, arrays 1-2
     items of ``items``, objects recurse (four levels deep at most).
  A prompt that ends inside an opened ``<tool_call>`` (how the gateway
     forces ``tool_choice`` "required" or a named function) is continued
     instead: the rest of the call for the named tool (or one chosen by the
     seed), then EOS, with no reasoning. (Families whose calls open with
     another marker are not continued this way.)
  3. With ``structured_outputs`` (``SIM_CONSTRAINTS``): right after the reasoning
     block (its trailing whitespace dropped, as a grammar would refuse it), an
     instance of the ``json`` schema (every required property, ``$ref`` into
     ``$defs`` resolved, ``maxLength``/``maxItems`` kept, common string
     ``format``s), one of the ``choice`` strings, or a ``json_object``; no tool
     call. Other kinds are refused (the engine checks ``BackendInfo.constraints``).
  4. Otherwise content: sentences of plain words with a few multi-byte ones
     (``世界``, ``🫠``, ``𓀀``, ``café``) so detokenizers meet split
     characters; ``output_tokens`` tokens exactly, or 16-64 words.

Token rules, the same in every mode, as vLLM's scheduler applies them:

- Each output token is checked in order: an EOS id ends the choice with
  finish ``stop`` (the EOS id is the last token, ``stop_reason`` null); then
  an id in ``stop_token_ids`` ends it with ``stop`` and that id as
  ``stop_reason``; then reaching the limit ends it with ``length``. The limit
  is ``max_tokens`` (null: no limit) capped by ``max_model_len`` minus the
  prompt. EOS ids are the request's ``eos_token_ids`` or, when it has none,
  the backend's (``generation_config.json``, else the tokenizer's EOS); the
  one emitted is the backend's first EOS when allowed, else the smallest.
- ``min_tokens``: EOS and stop ids are masked (skipped) until that many
  tokens were produced; a shorter plan is padded with words before its EOS.
- ``ignore_eos``: no EOS is emitted; words follow the plan until the limit.
- Plain-text padding and the ``ignore_eos`` tail are ASCII words, so a
  ``length`` cut in them never splits a character.

Determinism: every choice draws from its own random stream, seeded with
``seed``, the request's ``sampling.seed``, the prompt ids and the choice
index, so the same request gives the same ids (for one Python version) and
``n`` choices differ from each other. Echo and script plans come from the
prompt or the script alone (the streams then only pick padding words), and
script mode also depends on how many requests came before. Sampling knobs
(temperature, top-p, penalties, ...) are accepted and ignored.

Logprobs (``sampling.logprobs = k``; -1 means 20, more than 20 is refused as
vLLM refuses it by default) are synthetic but well formed: per token the
sampled id with rank 1 and a logprob in [-0.55, -0.05], and
``top_logprobs`` = the sampled entry, then ``k`` other ids with ranks
2..k+1 and logprobs falling by 1.5 per rank. They depend only on the token
and its position.

Timing: with ``prefill_us_per_token`` 0, the first step comes ``ttft_ms``
after ``generate`` starts iterating. Above 0, prefill is one lane per engine
(`prefill`), as a GPU's compute bound prefill is: prompts prefill one at a
time in arrival order, each for ``prefill_us_per_token`` per prompt token the
prefix cache did not hold, starting when the one before it ends (at its
planned end, so a late timer does not delay the rest), and the first step
comes ``ttft_ms`` after the request's own prefill ends (a fixed latency per
request, not queued). Requests queued whose prefill has not started are
``vllm:num_requests_waiting`` and, on their first output, the wait is
``queued_s``. A request aborted while queued leaves the lane at once, and one
aborted mid-prefill frees it at that moment: no work of theirs is charged to
the requests behind. A decode request of disaggregated serving
(``do_remote_prefill``: its KV cache arrives from the prefill engine) skips
the lane and the ``ttft_ms`` wait. Then one step every ``itl_ms``, on a fixed
schedule (a late consumer gets the next steps back to back, not a slower
pace). Each step yields one ``list[BackendOutput]`` with one entry per choice
still running, ``tokens_per_step`` tokens each (fewer on the final one). Waits
are timers on the event loop, never busy loops.

Requests are refused with `BackendRequestError` before any output for an
empty prompt, a prompt of ``max_model_len`` tokens or more, an id outside
the vocabulary (the tokenizer's full size, added tokens included), too many
logprobs, or a request id that is already running. Closing the generator,
cancelling its consumer, or ``abort(id)`` stops a request at once; after an
abort, the generator yields a last batch with finish ``abort`` for each
unfinished choice. ``close()`` aborts everything; ``generate`` then raises
`BackendError` until ``start()`` is called again. The tokenizer is loaded by
the constructor, so ``start()`` has nothing else to do but open the KV event
sockets.

Prefix cache (``prefix_caching``; `prefix_cache`): a request's prompt is
looked up when its prefill starts (in the lane, as vLLM's scheduler looks up a
waiting request when it schedules it, so a prompt queued behind one with the
same prefix finds its blocks; on arrival without the lane), its longest run of
leading full blocks held counting as cached (one block short of the whole
prompt at most: vLLM always computes the last prompt token); when its prefill
ends (with the first step without the lane) its full blocks are stored, the
held ones touched, the least recently used evicted past ``cache_blocks``. A
request's ``cache_salt`` goes into its first block, so only requests with the
same salt share blocks. Each choice's first output reports the hit as
``num_cached_tokens`` (None with prefix caching off). With the engine's
``--kv-events-config`` (`kv_publisher`), stores and evictions are published
as vLLM's ``BlockStored`` and ``BlockRemoved`` events, one batch per pass of
the event loop, and a reset of the cache as ``AllBlocksCleared``.

Modules, one step each:

- `config`: `SimBackendConfig` and `SimConfigError`;
- `tokenizer`: the tokenizer folder, its vocabulary size and EOS ids;
- `words`: prose built from word pieces encoded once;
- `prompt`: the ChatML structure read from the prompt's ids;
- `schema`: tool arguments and structured-output answers from JSON schema;
- `plans`: each mode's plan, the ids before the token rules;
- `stream`: one choice's token stream under the stop rules, and synthetic logprobs;
- `prefix_cache`: the chained block hashes, lookup, store and LRU eviction;
- `prefill`: the prefill lane, one prompt's prefill at a time, in arrival order;
- `kv_publisher`: vLLM's KV cache events on ZMQ PUB, with the replay ROUTER;
- `backend`: `SimBackend`, its request checks, disaggregated handshake and pace.
"""

from engine.backends.sim.backend import MAX_LOGPROBS, SimBackend
from engine.backends.sim.config import SimBackendConfig, SimConfigError

__all__ = ["MAX_LOGPROBS", "SimBackend", "SimBackendConfig", "SimConfigError"]
