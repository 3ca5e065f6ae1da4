"""Ledger checkpoints: a rebuild continues from the newest one and reads only the log's tail.

A checkpoint is what a rebuild needs to go on exactly as if it had never stopped
(DESIGN §7.7): the next offset of every input partition, each task's log-time clock, the
rollouts already answered (oldest first), the open rollouts' own events as the log holds
them, and how many rows the rebuilt ledger held at the cut. Not the ledger's objects:
its state is a function of those events (the ledger's ``resume``), so the format is the
log's own and outlives changes to the ledger's internals. Not the rebuilt ledger either:
that store is extended in place, round after round (``continued``), so a restart costs
the tail, not a copy of the history; the checkpoint names the store (its id) and the
rows it must hold.

One small SQLite file per checkpoint. Its name carries its sequence number and the
SHA-256 of its bytes (``ledger-00000007-<hex>.ckpt``), and it appears by an atomic
rename once complete, so a partial or corrupt file is told by its name, read by nobody,
and the previous checkpoint used. Its identity (topic prefix, cluster, event schema,
partitions, the ledger's settings, the store) must match the rebuild's, or it is refused
naming what differs.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from stages.ports import Consumed, TopicPartition
from topics.codec import DecodeError, decode

FORMAT = 1
KEEP = 2
"""Checkpoints kept: the newest, and one to fall back on if it turns out corrupt."""
_NAME = re.compile(r"^ledger-(\d{8})-([0-9a-f]{64})\.ckpt$")
_PARTIAL = ".partial"

_TABLES = """
CREATE TABLE checkpoint_identity (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE checkpoint_offsets (topic TEXT, partition INTEGER, next_offset INTEGER,
                                 PRIMARY KEY (topic, partition));
CREATE TABLE checkpoint_clocks (task INTEGER PRIMARY KEY, now REAL NOT NULL);
CREATE TABLE checkpoint_answered (seq INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL);
CREATE TABLE checkpoint_events (seq INTEGER PRIMARY KEY, topic TEXT, partition INTEGER,
                                offset INTEGER, timestamp REAL, key BLOB, value BLOB,
                                headers BLOB);
CREATE TABLE checkpoint_summary (events_covered INTEGER NOT NULL, store_rows INTEGER NOT NULL);
"""


class CheckpointRefused(ValueError):
    """A checkpoint that cannot be continued from; the message names why."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What a checkpoint must share with the rebuild that continues from it."""

    prefix: str
    cluster: str
    schema: int
    partitions: int
    ledger: str
    """The ledger's settings (seal grace, open limit, memory): other settings decide otherwise."""
    store: str
    """The id of the rebuilt ledger the checkpoints extend (``LedgerStore.store_id``)."""

    def items(self) -> dict[str, str]:
        return {
            "format": str(FORMAT),
            "prefix": self.prefix,
            "cluster": self.cluster,
            "schema": str(self.schema),
            "partitions": str(self.partitions),
            "ledger": self.ledger,
            "store": self.store,
        }


@dataclass(slots=True)
class Cut:
    """The rebuild's state where a checkpoint is cut."""

    offsets: dict[TopicPartition, int]
    clocks: dict[int, float]
    answered: list[str]
    events: list[Consumed]
    events_covered: int
    store_rows: int
    """Rows the rebuilt ledger held at the cut: a store holding fewer is not the one cut."""


@dataclass(slots=True)
class Loaded:
    """A verified checkpoint: its file, where it cut the log, and what ``resume`` takes."""

    path: Path
    seq: int
    cut: Cut


@dataclass(slots=True)
class Found:
    """The newest usable checkpoint (None: rebuild from the log) and every one passed over, why."""

    loaded: Loaded | None
    skipped: list[str] = field(default_factory=list)


def write(directory: Path, identity: Identity, cut: Cut) -> Path:
    """Write a checkpoint at ``cut``; keep the newest ``KEEP``."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"*{_PARTIAL}"):  # left by a writer killed mid-way
        stale.unlink()
    seq = max((seq for seq, _ in _listed(directory)), default=0) + 1
    partial = directory / f"ledger-{seq:08d}{_PARTIAL}"
    with closing(sqlite3.connect(partial)) as target:
        target.executescript(_TABLES)
        target.executemany("INSERT INTO checkpoint_identity VALUES (?, ?)", identity.items().items())
        target.executemany(
            "INSERT INTO checkpoint_offsets VALUES (?, ?, ?)",
            [(tp[0], tp[1], offset) for tp, offset in cut.offsets.items()],
        )
        target.executemany("INSERT INTO checkpoint_clocks VALUES (?, ?)", cut.clocks.items())
        target.executemany("INSERT INTO checkpoint_answered VALUES (?, ?)", enumerate(cut.answered))
        target.executemany("INSERT INTO checkpoint_events VALUES (?, ?, ?, ?, ?, ?, ?, ?)", _rows(cut.events))
        target.execute("INSERT INTO checkpoint_summary VALUES (?, ?)", (cut.events_covered, cut.store_rows))
        target.commit()
    final = directory / f"ledger-{seq:08d}-{_sha256(partial)}.ckpt"
    partial.rename(final)
    for _, old in _listed(directory)[KEEP:]:
        old.unlink()
    return final


def newest(directory: Path, identity: Identity, store_rows: int) -> Found:
    """The newest checkpoint in ``directory`` that is whole, belongs to this rebuild, and
    whose rows the store (holding ``store_rows``) still holds."""
    found = Found(None)
    for seq, path in _listed(directory):
        try:
            cut = _read(path, identity)
            if cut.store_rows > store_rows:
                raise CheckpointRefused(
                    f"the ledger holds {store_rows} rows, fewer than the {cut.store_rows} at its cut"
                )
            found.loaded = Loaded(path, seq, cut)
            return found
        except CheckpointRefused as exc:
            found.skipped.append(f"checkpoint {path.name}: {exc}")
    return found


def _listed(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint files, newest first."""
    if not directory.is_dir():
        return []
    named = [(_NAME.match(path.name), path) for path in directory.iterdir()]
    return sorted(((int(match.group(1)), path) for match, path in named if match), reverse=True)


def _read(path: Path, identity: Identity) -> Cut:
    match = _NAME.match(path.name)
    assert match is not None
    if _sha256(path) != match.group(2):
        raise CheckpointRefused("corrupt: its bytes do not match the SHA-256 in its name")
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            stored = dict(db.execute("SELECT name, value FROM checkpoint_identity"))
            differs = [
                f"{name} {stored.get(name)!r} (this rebuild: {value!r})"
                for name, value in identity.items().items()
                if stored.get(name) != value
            ]
            if differs:
                raise CheckpointRefused("another log or ledger: " + "; ".join(differs))
            offsets = {
                (topic, partition): offset
                for topic, partition, offset in db.execute("SELECT * FROM checkpoint_offsets")
            }
            clocks = dict(db.execute("SELECT task, now FROM checkpoint_clocks"))
            answered = [
                row[0] for row in db.execute("SELECT rollout_id FROM checkpoint_answered ORDER BY seq")
            ]
            events = [_consumed(row) for row in db.execute("SELECT * FROM checkpoint_events ORDER BY seq")]
            covered, rows = db.execute("SELECT events_covered, store_rows FROM checkpoint_summary").fetchone()
    except CheckpointRefused:
        raise
    except (sqlite3.Error, orjson.JSONDecodeError, DecodeError, TypeError, ValueError) as exc:
        raise CheckpointRefused(f"unreadable: {exc}") from None
    return Cut(offsets, clocks, answered, events, covered, rows)


def _rows(events: Iterable[Consumed]) -> Iterable[tuple[object, ...]]:
    for seq, item in enumerate(events):
        raw = item.as_raw()
        headers = orjson.dumps([[name, value.decode("latin-1")] for name, value in raw.headers])
        yield seq, item.topic, item.partition, item.offset, item.timestamp, raw.key, raw.value, headers


def _consumed(row: Sequence[Any]) -> Consumed:
    _, topic, partition, offset, timestamp, key, value, headers = row
    pairs = [(name, text.encode("latin-1")) for name, text in orjson.loads(headers)]
    return Consumed(str(topic), int(partition), int(offset), decode(key, value, pairs), float(timestamp))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["CheckpointRefused", "Cut", "Found", "Identity", "Loaded", "newest", "write"]
