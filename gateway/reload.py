"""Hot reload of a config file (the policy, the API keys): on SIGHUP and when it changes.

A new value is decoded completely before it replaces the old one (one
attribute assignment), so a request sees either version whole; requests
already past the check keep what they saw. A file that does not load keeps
the old value and logs why. Replace files atomically (write a sibling, then
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
    def __init__(self, path: str | Path, load: Callable[[Path], T], what: str, errors: tuple[type[Exception], ...]) -> None:
        self.path = Path(path)
        self._load = load
        self._what = what
        self._errors = errors
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
        except self._errors as exc:
            self.rejected += 1
            log.error("%s not reloaded, keeping the previous one: %s", self._what, exc)
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
            if self.changed():
                self.reload()
