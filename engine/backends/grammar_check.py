"""Compile a constraint in a child process first, then in the engine (issue #27).

llguidance compiles by recursion on the calling thread's stack and panics past 65,525
symbols; a deep enough grammar or `$ref` chain overflows the stack and kills the whole
process with SIGSEGV, and an engine behind a gateway pool took every engine of the pool
with it. The size bounds (`wire.grammar_limits`) refuse what is known to crash; this is
the isolation for what they do not foresee: `GrammarCheck` sends each constraint to one
long-lived child (`grammar_child`), which compiles it on a stack of CHECK_STACK_BYTES.
A constraint that kills the child, or takes longer than the timeout, is a 400 and the
child is started again for the next one; only a constraint the child compiled is then
compiled in the engine, on `compile_executor`'s thread, whose stack is 4× larger, off the
event loop (a 10,000-symbol grammar takes a second to compile; `/health` must not wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from engine.backends.base import BackendError, BackendRequestError
from engine.backends.grammar_child import CHECK_STACK_BYTES
from wire.protocol import StructuredOutputs

log = logging.getLogger("onehop.engine.grammar")

COMPILE_STACK_BYTES = 4 * CHECK_STACK_BYTES
"""The stack of the engine's compile thread (see `grammar_child`)."""
DEFAULT_TIMEOUT_S = 10.0
_FRAME = struct.Struct(">I")
_ENCODE = msgspec.json.Encoder().encode
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `engine`


def compile_executor() -> ThreadPoolExecutor:
    """One thread with a stack of COMPILE_STACK_BYTES (made now: the size applies at creation)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="onehop-grammar")
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        executor.submit(int).result()
    finally:
        threading.stack_size(previous)
    return executor


class GrammarCheck:
    """The child process that compiles each constraint before the engine does; one at a time."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the child now rather than on the first constraint (it imports for ~0.3 s)."""
        async with self._lock:
            await self._running()

    async def close(self) -> None:
        async with self._lock:
            await self._stop()

    async def check(self, constraint: StructuredOutputs) -> None:
        """Return when the child compiled `constraint`; raise BackendRequestError otherwise."""
        kind = constraint.kind
        async with self._lock:
            process = await self._running()
            try:
                answer = await asyncio.wait_for(self._exchange(process, _ENCODE(constraint)), self._timeout_s)
            except TimeoutError as exc:
                await self._stop()
                raise BackendRequestError(
                    f"structured_outputs.{kind} did not compile within {self._timeout_s:g} s"
                    " (backend_options.grammar_timeout_s)"
                ) from exc
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                code = await self._stop()
                log.warning("the grammar check process died (exit %s) compiling structured_outputs.%s", code, kind)
                raise BackendRequestError(
                    f"structured_outputs.{kind} crashed the grammar compiler (exit {code}) and is refused;"
                    " it was compiled in a separate process, and this engine serves on"
                ) from exc
            except BaseException:  # cancelled mid-exchange: its answer would be read as the next one's
                await self._stop()
                raise
        if answer:
            raise BackendRequestError(answer)

    async def _exchange(self, process: asyncio.subprocess.Process, body: bytes) -> str:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(_FRAME.pack(len(body)) + body)
        await process.stdin.drain()
        (size,) = _FRAME.unpack(await process.stdout.readexactly(_FRAME.size))
        return (await process.stdout.readexactly(size)).decode()

    async def _running(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        await self._stop()
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _PACKAGE_ROOT + (os.pathsep + path if path else "")}
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.backends.grammar_child",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            )
        except OSError as exc:
            raise BackendError(f"cannot start the grammar check process: {exc}") from exc
        return self._process

    async def _stop(self) -> int | None:
        """End the child (if any) and return its exit status."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        code = await process.wait()
        transport = getattr(process, "_transport", None)  # closed here, or a ResourceWarning at collection
        if transport is not None:
            transport.close()
        return code
