"""Hot reload of a config file (the policy, the API keys): on SIGHUP and when it changes.

A new value is decoded completely before it replaces the old one (one
attribute assignment), so a request sees either version whole; requests
already past the check keep what they saw. A file that does not load keeps
the old value and logs why, whatever went wrong (bad YAML, bytes that are
not UTF-8, a file that vanished): the watcher never stops. Files are read
on a worker thread, never on the event loop. Replace files atomically (write a sibling, then
rename; a Kubernetes ConfigMap update does this): a file caught half-written
may decode as a different, valid one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class WatchedFile(Generic[T]):
    def __init__(self, path: str | Path, load: Callable[[Path], T], what: str) -> None:
        """Load the file now (blocking: call it off the loop); a file that does not load is an error."""
        self.path = Path(path)
        self._load = load
        self._what = what
        self._stamp = self._read_stamp()
        self.current: T = load(self.path)
        self.reloads = 0
        self.rejected = 0

    def _read_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def reload(self) -> bool:
        """Load the file again; keep the old value if it does not load."""
        self._stamp = self._read_stamp()
        try:
            value = self._load(self.path)
        except Exception as exc:  # any failure keeps the last good value: a watcher must not stop
            self.rejected += 1
            log.error(
                "%s not reloaded from %s, keeping the previous one: %s: %s",
                self._what,
                self.path,
                type(exc).__name__,
                exc,
            )
            return False
        self.current = value
        self.reloads += 1
        log.info("%s reloaded from %s", self._what, self.path)
        return True

    def changed(self) -> bool:
        return self._read_stamp() != self._stamp

    async def watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if await asyncio.to_thread(self.changed):
                await asyncio.to_thread(self.reload)
