"""Handing freed heap back to the OS once start-up's large, short-lived allocations are gone.

Loading a tokenizer parses a multi-megabyte `tokenizer.json`: for Qwen3's
151k-token vocabulary about 55 MB of parse tree is freed again right after,
but glibc keeps freed pages in its arenas (one per loading thread), so the
gateway would sit at that high-water mark for its whole life. `malloc_trim`
returns them. Elsewhere (musl, macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    try:
        process = ctypes.CDLL(None)  # the symbols already loaded, libc's among them
    except (OSError, TypeError):  # no dlopen of the process itself (Windows)
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
