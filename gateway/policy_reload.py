"""Hot reload of the policy file: on SIGHUP and when the file changes.

A new policy is decoded completely before it replaces the old one (one
attribute assignment), so a request sees either policy whole; requests
already routed keep their decision. An invalid file keeps the old policy and
logs why. Replace the file atomically (write a sibling, then rename; a
Kubernetes ConfigMap update does this): a file caught half-written may decode
as a different, valid policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from gateway.policy import Policy, PolicyError, load_policy

log = logging.getLogger(__name__)


class PolicyFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp = self._read_stamp()
        self.current: Policy = load_policy(self.path)
        self.reloads = 0
        self.rejected = 0

    def _read_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def reload(self) -> bool:
        """Load the file again; keep the old policy if it does not decode."""
        self._stamp = self._read_stamp()
        try:
            policy = load_policy(self.path)
        except PolicyError as exc:
            self.rejected += 1
            log.error("policy not reloaded, keeping the previous one: %s", exc)
            return False
        self.current = policy
        self.reloads += 1
        log.info("policy reloaded from %s", self.path)
        return True

    def changed(self) -> bool:
        return self._read_stamp() != self._stamp

    async def watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.changed():
                self.reload()
