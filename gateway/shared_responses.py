"""The Responses store the workers of `onehop gateway --workers N` share.

With several workers on one port, a client's follow-up (`previous_response_id`,
`GET /v1/responses/{id}`) lands on whichever worker the kernel picks, so the
stored answers live in one SQLite file in the run's folder (WAL: readers do
not wait for a writer), bounded as the single-process store is: 10,000
responses and 64 MiB of encoded JSON, the least recently used evicted first.
A single-process gateway keeps its in-memory `ResponseStore`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec

from engine.openai_schema import ChatMessageParam
from gateway.responses import MAX_STORED, MAX_STORED_BYTES, Response, ResponseStore, StoredResponse
from gateway.workers import run_dir

_encode = msgspec.json.Encoder().encode
_CONVERSATION = msgspec.json.Decoder(list[ChatMessageParam])
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    body BLOB NOT NULL,
    conversation BLOB NOT NULL,
    size INTEGER NOT NULL,
    used INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
"""
BUSY_TIMEOUT_S = 5.0


class SharedResponseStore:
    """`ResponseStore`'s interface over an SQLite file several processes open."""

    def __init__(self, path: Path, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # One connection per worker, used on its event loop only; autocommit, with
        # explicit transactions where a change spans statements.
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(self, response_id: str, response: Response | bytes, conversation: list[ChatMessageParam]) -> bool:
        """False when the entry alone is over the byte bound: it is not kept."""
        body = response if isinstance(response, bytes) else _encode(response)
        history = _encode(conversation)
        size = len(body) + len(history)
        with self._transaction():
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            if size > self.max_bytes:
                return False
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, (SELECT COALESCE(MAX(used), 0) + 1 FROM responses))",
                (response_id, body, history, size),
            )
            self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._transaction():
            row = self._db.execute(
                "SELECT body, conversation, size FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None:
                return None
            self._db.execute(
                "UPDATE responses SET used = (SELECT MAX(used) + 1 FROM responses) WHERE id = ?", (response_id,)
            )
        body, history, size = row
        return StoredResponse(msgspec.Raw(body), _CONVERSATION.decode(history), size)

    def delete(self, response_id: str) -> bool:
        return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        self._db.close()

    def _evict(self) -> None:
        count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        while count > self.max_entries or total > self.max_bytes:
            oldest = self._db.execute("SELECT id, size FROM responses ORDER BY used LIMIT 1").fetchone()
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


def response_store() -> ResponseStore | SharedResponseStore:
    """The run's shared store under `--workers N`, else this process's own."""
    folder = run_dir()
    return SharedResponseStore(folder / "responses.sqlite") if folder is not None else ResponseStore()
