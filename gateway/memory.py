"""Handing freed heap back to the OS once start-up's large, short-lived allocations are gone.

Loading a tokenizer parses a multi-megabyte `tokenizer.json`: for Qwen3's
151k-token vocabulary about 55 MB of parse tree is freed again right after,
but glibc keeps freed pages in its arenas (one per loading thread), so the
gateway would sit at that high-water mark for its whole life. `malloc_trim`
returns them. Elsewhere (musl, macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util



def release_freed_memory() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)
