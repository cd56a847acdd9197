"""The Responses store the workers of `onehop gateway --workers N` share.

With several workers on one port, a client's follow-up (`previous_response_id`,
`GET /v1/responses/{id}`) lands on whichever worker the kernel picks, so the
stored answers live in one SQLite file in the run's folder (WAL: readers do
not wait for a writer), scoped and bounded as the single-process store is
(`gateway.apis.response_store`: each owner's share, then the whole store's bound, the
least recently used evicted first; sizes counted alike). A single-process
gateway keeps its in-memory `ResponseStore`; with `state: {backend: redis}` every worker
and replica uses the Redis server instead (`gateway.apis.redis_responses`).

Its calls block (on the file, on another worker's write lock), so requests reach it through
`InProcess` on a thread of its own, each call bounded by `state.timeout_s`. A read waits for
no write lock: it reads, then marks the entry used in a statement of its own, skipped while
another worker writes.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import msgspec

from wire.openai_schema import ChatMessageParam
from gateway.config import ResponseStoreConfig, StateConfig
from gateway.apis.redis_responses import RedisResponseStore
from gateway.apis.response_store import InProcess, ResponseStorage, ResponseStore, StoredResponse, entry_size
from gateway.serving.worker_env import run_dir

_encode = msgspec.json.Encoder().encode
_CONVERSATION = msgspec.json.Decoder(list[ChatMessageParam])
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    body BLOB NOT NULL,
    conversation BLOB NOT NULL,
    size INTEGER NOT NULL,
    used INTEGER NOT NULL,
    session TEXT
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
CREATE INDEX IF NOT EXISTS responses_owner_used ON responses (owner, used);
"""
BUSY_TIMEOUT_S = 5.0
_SET_UP_RETRY_S = 0.02


class SharedResponseStore:
    """`ResponseStore`'s interface over an SQLite file several processes open."""

    def __init__(
        self, path: Path, bounds: ResponseStoreConfig | None = None, busy_timeout_s: float = BUSY_TIMEOUT_S
    ) -> None:
        self.bounds = bounds or ResponseStoreConfig()
        self._busy_timeout_s = busy_timeout_s
        # One connection per worker, used by one thread at a time (`InProcess`'s); autocommit,
        # with explicit transactions where a change spans statements.
        self._db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._set_up(busy_timeout_s)

    def _set_up(self, timeout_s: float) -> None:
        """WAL and the schema, retried while another worker sets them up: workers start together,
        and SQLite answers a journal-mode change that meets another connection's lock with "database
        is locked" at once, without waiting on the busy timeout (1 in ~180 openings of a fresh file
        by six processes at once; a worker crashed on it at start-up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.executescript(_SCHEMA)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(_SET_UP_RETRY_S)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(
        self,
        owner: str,
        response_id: str,
        response: bytes,
        conversation: list[ChatMessageParam],
        session: str | None = None,
    ) -> bool:
        history = _encode(conversation)
        size = entry_size(response, history, session)
        with self._transaction():
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            if size > self.bounds.max_tenant_bytes:
                return False
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, (SELECT COALESCE(MAX(used), 0) + 1 FROM responses), ?)",
                (response_id, owner, response, history, size, session),
            )
            self._evict(owner)
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._db.execute(  # WAL: a read waits for no writer
            "SELECT body, conversation, session FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        ).fetchone()
        if row is None:
            return None
        self._touch(owner, response_id)
        body, history, session = row
        return StoredResponse(msgspec.Raw(body), _CONVERSATION.decode(history), session)

    def delete(self, owner: str, response_id: str) -> bool:
        deleted = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return deleted.rowcount > 0

    def close(self) -> None:
        self._db.close()

    def _touch(self, owner: str, response_id: str) -> None:
        """Mark the entry used, in a statement of its own (gone meanwhile, it changes nothing),
        without waiting: while another worker holds the write lock the read is answered and
        this use is not counted (the entry keeps its place in the order)."""
        self._db.execute("PRAGMA busy_timeout = 0")
        try:
            self._db.execute(
                "UPDATE responses SET used = (SELECT MAX(used) + 1 FROM responses) WHERE id = ? AND owner = ?",
                (response_id, owner),
            )
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
        finally:
            self._db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")

    def _evict(self, owner: str) -> None:
        """The owner's least recently used past its share, then anyone's past the whole bound."""
        bounds = self.bounds
        self._evict_past(bounds.max_tenant_entries, bounds.max_tenant_bytes, "WHERE owner = ?", (owner,))
        self._evict_past(bounds.max_entries, bounds.max_bytes, "", ())

    def _evict_past(self, max_entries: int, max_bytes: int, where: str, args: tuple[str, ...]) -> None:
        count, total = self._db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses {where}", args
        ).fetchone()
        while count > max_entries or total > max_bytes:
            oldest = self._db.execute(f"SELECT id, size FROM responses {where} ORDER BY used LIMIT 1", args).fetchone()
            self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
            count, total = count - 1, total - oldest[1]

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE … COMMIT (ROLLBACK on an exception): the write lock is taken up front,
    so two workers updating `used` never deadlock on a lock upgrade."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")


def response_storage(state: StateConfig, bounds: ResponseStoreConfig | None = None) -> ResponseStorage:
    """The Redis server's store with `state.backend: redis`; else the run's SQLite file under
    `--workers N`, or this process's own memory."""
    if state.backend == "redis":
        return RedisResponseStore(state, bounds)
    folder = run_dir()
    if folder is None:
        return InProcess(ResponseStore(bounds))
    shared = SharedResponseStore(folder / "responses.sqlite", bounds, busy_timeout_s=state.timeout_s)
    return InProcess(shared, timeout_s=state.timeout_s)
