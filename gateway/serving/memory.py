"""Start-up's heap: freed pages handed back to the OS, what stays kept out of the collector's walk.

Loading a tokenizer parses a multi-megabyte `tokenizer.json`: for Qwen3's
151k-token vocabulary about 55 MB of parse tree is freed again right after,
but glibc keeps freed pages in its arenas (one per loading thread), so the
gateway would sit at that high-water mark for its whole life. `malloc_trim`
returns them. Elsewhere (musl, macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> None:
    try:
        process = ctypes.CDLL(None)  # the symbols already loaded, libc's among them
    except (OSError, TypeError):  # no dlopen of the process itself (Windows)
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)


def freeze_start_heap() -> None:
    """Take what start-up built out of the cyclic collector's sight (`gc.freeze`).

    A full collection walks every tracked object with the loop stopped: with a vocabulary's
    decode tables and the parsers loaded, that was 25–55 ms, landing on whichever requests
    were in flight (a 128-stream burst, docs/performance.md); frozen, it walks only what
    the process made since (~7 ms). A frozen object is never collected as part of a cycle,
    so start-up's garbage is collected first; what is frozen is what serves for the whole
    process (models, engine clients, parsers), and the policy and key files a reload
    replaces are freed by their reference counts.
    """
    gc.collect()
    gc.freeze()
