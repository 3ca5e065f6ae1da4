"""A local SQLite copy of the token-free ledger: call records, failed calls, receipts.

It is an ``EventSink``, so the ledger stage can write into it instead of Kafka (that
is how ``replay`` rebuilds the ledger), and it applies each event id once, first
write wins, exactly as every Kafka consumer of the ledger does.
"""

from __future__ import annotations

import math
import sqlite3
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import orjson

from topics.codec import encode_payload
from topics.events import envelope
from topics.records import CallRecord, FailedCall, Record, RolloutReceipt

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    event_id   TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    kind       TEXT NOT NULL,
    payload    BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_rollout ON ledger (rollout_id);
CREATE TABLE IF NOT EXISTS store_identity (id TEXT NOT NULL);
"""

LEDGER_KINDS = {"call_committed", "call_failed", "receipt"}


class LedgerStore:
    """Ledger events in one SQLite file, keyed by event id."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        # A rebuildable copy: speed over durability (the log is the source of truth).
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.executescript(SCHEMA)
        self._id = self._identity()
        self.ignored = 0

    def _identity(self) -> str:
        found = self._db.execute("SELECT id FROM store_identity").fetchone()
        if found is not None:
            return str(found[0])
        minted = uuid.uuid4().hex
        self._db.execute("INSERT INTO store_identity VALUES (?)", (minted,))
        self._db.commit()
        return minted

    def close(self) -> None:
        self._db.commit()
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def publish(self, records: Sequence[Record]) -> None:
        self.add(records)

    def add(self, records: Sequence[Record]) -> None:
        """Store ledger events; anything else (dead letters) is counted and skipped.

        Payloads are the events' wire JSON (``encode_payload``: the same bytes as
        ``orjson.dumps(record.model_dump())``, about twice as fast for a call record),
        so a rebuilt store and a materialized one, or one written before, compare byte
        for byte."""
        rows = []
        for record in records:
            event = envelope(record)
            kind = event.event_type.value
            if kind not in LEDGER_KINDS:
                self.ignored += 1
                continue
            rows.append((event.event_id, event.key, kind, encode_payload(record)))
        self._db.executemany("INSERT OR IGNORE INTO ledger VALUES (?, ?, ?, ?)", rows)

    def merge(self, other: str | Path) -> None:
        """Copy every event of the store in file ``other`` into this one (first write
        wins, as in ``add``)."""
        self._db.commit()
        self._db.execute("ATTACH DATABASE ? AS other", (str(other),))
        try:
            self._db.execute("INSERT OR IGNORE INTO ledger SELECT * FROM other.ledger")
            self._db.commit()
        finally:
            self._db.execute("DETACH DATABASE other")

    def flush(self) -> None:
        self._db.commit()

    @property
    def store_id(self) -> str:
        """This store's own id, minted when it was created: which ledger checkpoints extend."""
        return self._id

    def rows(self) -> int:
        """Rows ever stored (rows are never deleted, so this only grows)."""
        self._db.commit()
        (rows,) = self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM ledger").fetchone()
        return int(rows)

    def counts(self) -> dict[str, int]:
        self.flush()
        return dict(self._db.execute("SELECT kind, COUNT(*) FROM ledger GROUP BY kind").fetchall())

    def rollout(self, rollout_id: str) -> tuple[list[CallRecord | FailedCall], RolloutReceipt | None]:
        calls: list[CallRecord | FailedCall] = []
        receipt = None
        self.flush()
        for kind, payload in self._db.execute(
            "SELECT kind, payload FROM ledger WHERE rollout_id = ? ORDER BY event_id", (rollout_id,)
        ):
            data = orjson.loads(payload)
            if kind == "receipt":
                receipt = RolloutReceipt.model_validate(data)
            elif kind == "call_committed":
                calls.append(CallRecord.model_validate(data))
            else:
                calls.append(FailedCall.model_validate(data))
        return calls, receipt

    def snapshot(self) -> dict[str, bytes]:
        """Every event id with its payload: what a consistency check compares."""
        self.flush()
        return dict(self._db.execute("SELECT event_id, payload FROM ledger").fetchall())


def tree_order(calls: Sequence[CallRecord | FailedCall]) -> list[tuple[CallRecord | FailedCall, int]]:
    """Calls depth first from each root, with their depth: a parent before its children,
    siblings in the order they were admitted (failed calls, which carry no time, after
    them by id). A call whose parent is not listed counts as a root."""
    ids = {call.call_id for call in calls}
    children: dict[str | None, list[CallRecord | FailedCall]] = {}
    for call in calls:
        parent = call.parent_call_id if call.parent_call_id in ids else None
        children.setdefault(parent, []).append(call)

    def admitted(call: CallRecord | FailedCall) -> tuple[float, str]:
        return (call.admitted_at if isinstance(call, CallRecord) else math.inf, call.call_id)

    ordered: list[tuple[CallRecord | FailedCall, int]] = []
    seen: set[str] = set()
    stack = [(call, 0) for call in sorted(children.get(None, []), key=admitted, reverse=True)]
    while stack:
        call, depth = stack.pop()
        if call.call_id in seen:
            continue  # parents in a cycle: each call once
        seen.add(call.call_id)
        ordered.append((call, depth))
        stack += [
            (child, depth + 1) for child in sorted(children.get(call.call_id, []), key=admitted, reverse=True)
        ]
    ordered += [(call, 0) for call in calls if call.call_id not in seen]
    return ordered
