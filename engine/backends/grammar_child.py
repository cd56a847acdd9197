"""`python -m engine.backends.grammar_child`: compiles structured-output constraints for an
hf engine (`grammar_check.GrammarCheck`), so that a constraint that crashes the grammar
library kills this process, not the engine.

Frames on stdin and stdout: a 4-byte big-endian length, then the body. In: a
`StructuredOutputs` as JSON. Out: the error text, empty when the constraint compiles.
Each compile runs on a thread with a stack of CHECK_STACK_BYTES, a quarter of the smallest
stack the engine compiles on (`grammar_check.COMPILE_STACK_BYTES`): the library recurses
by the constraint's depth, so what compiles here compiles there with room to spare.
"""

from __future__ import annotations

import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import msgspec

from wire.grammar_compile import GrammarError, compile_grammar
from wire.protocol import ProtocolError, StructuredOutputs

CHECK_STACK_BYTES = 2 * 1024 * 1024
_FRAME = struct.Struct(">I")
_DECODE = msgspec.json.Decoder(StructuredOutputs).decode


def check(body: bytes) -> str:
    """The error compiling the constraint in `body`, or "" when it compiles."""
    try:
        compile_grammar(_DECODE(body))
    except GrammarError as exc:
        return str(exc)
    except (msgspec.ValidationError, msgspec.DecodeError, ProtocolError) as exc:
        return f"invalid structured_outputs: {exc}"
    return ""


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """Answer frames until `source` ends (the engine closed it or exited)."""
    threading.stack_size(CHECK_STACK_BYTES)
    with ThreadPoolExecutor(1, thread_name_prefix="onehop-grammar-check") as pool:
        while len(header := source.read(_FRAME.size)) == _FRAME.size:
            (size,) = _FRAME.unpack(header)
            answer = pool.submit(check, source.read(size)).result().encode()
            sink.write(_FRAME.pack(len(answer)) + answer)
            sink.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
