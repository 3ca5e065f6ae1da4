"""Offsets a killed durable broker claimed but never wrote: given back before it restarts.

tansu's durable engine takes a produce's offsets by advancing the partition's watermark
object, then writes the batch object at them. A broker killed between the two writes
(a ``kill -9`` of a run kills it with everything else) leaves the watermark past the
partition's last batch. Those offsets never come to exist: a fetch from the first of
them returns nothing until a later batch is written, so a reader that reads up to the
high watermark (a stage recalling what it answered) waits forever, and a consumer
group's lag on that partition stays above 0 (measured, DESIGN §3). No producer was told
the offsets were written (tansu answers a produce after both writes), so before tansu
starts the supervisor lowers such a watermark to the end of the last batch, and the next
produce takes the offsets again. No record past that end was ever read; only a high
watermark read between the two writes could name an offset past it (DESIGN §3).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import localbucket

WATERMARK = "watermark.json"
BATCH_SUFFIX = ".batch"
LAST_OFFSET_DELTA = slice(23, 27)
"""Where a Kafka record batch (v2) keeps its last offset's distance from its first:
after base offset (8 bytes), length (4), leader epoch (4), magic (1), CRC (4) and
attributes (2)."""


@dataclass(frozen=True, slots=True)
class GivenBack:
    """One partition whose watermark claimed offsets no batch holds."""

    topic: str
    partition: int
    written_end: int
    """The offset after the partition's last batch: its watermark now."""
    claimed_end: int
    """What the watermark said."""

    def describe(self) -> str:
        return (
            f"{self.topic}[{self.partition}]: offsets {self.written_end}..{self.claimed_end - 1} were "
            f"claimed by a killed broker and never written; the watermark goes back from "
            f"{self.claimed_end} to {self.written_end}"
        )


def give_back_unwritten(cluster_dir: Path) -> list[GivenBack]:
    """Lower every watermark under ``cluster_dir`` (the store's ``clusters/ID``) that is past
    its partition's last batch; returns what was lowered. Only while no broker runs on it."""
    given_back: list[GivenBack] = []
    for watermark_path in sorted(cluster_dir.glob(f"topics/*/partitions/*/{WATERMARK}")):
        partition_dir = watermark_path.parent
        watermark = read_watermark(watermark_path)
        claimed = watermark.get("high")
        if not isinstance(claimed, int):
            continue
        low = watermark.get("low")
        written = max(written_end(partition_dir / "records"), low if isinstance(low, int) else 0)
        if claimed <= written:
            continue
        write_watermark(watermark_path, {**watermark, "high": written})
        given_back.append(
            GivenBack(partition_dir.parent.parent.name, int(partition_dir.name), written, claimed)
        )
    return given_back


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One batch object of a partition."""

    base: int
    """Its first offset (its name)."""
    size: int
    written_at: float
    """Seconds since the epoch (the object's time)."""
    path: Path


def stored_batches(records_dir: Path) -> list[StoredBatch]:
    """A partition's batch objects in offset order (their names are zero-padded offsets),
    read from the folder; one deleted while it is read is left out."""
    batches: list[StoredBatch] = []
    try:
        with os.scandir(records_dir) as entries:
            names = sorted(entry.name for entry in entries if entry.name.endswith(BATCH_SUFFIX))
    except FileNotFoundError:
        return []
    for name in names:
        path = records_dir / name
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        batches.append(StoredBatch(int(name.removesuffix(BATCH_SUFFIX)), stat.st_size, stat.st_mtime, path))
    return batches


def written_end(records_dir: Path) -> int:
    """The offset after the last batch in ``records_dir`` (0 if it holds none). A batch
    object is named by its first offset; a write is atomic (a rename), so a batch is whole."""
    batches = stored_batches(records_dir)
    return batch_end(batches[-1].path, batches[-1].base) if batches else 0


def batch_end(path: Path, base: int) -> int:
    """The offset after the last one the batch object at ``path`` (first offset ``base``)
    covers, read from its header."""
    with path.open("rb") as batch:
        header = batch.read(LAST_OFFSET_DELTA.stop)
    if len(header) < LAST_OFFSET_DELTA.stop:
        raise ValueError(f"{path}: a record batch shorter than its header ({len(header)} bytes)")
    return base + int.from_bytes(header[LAST_OFFSET_DELTA], "big", signed=True) + 1


def read_watermark(path: Path) -> dict[str, Any]:
    watermark = json.loads(path.read_bytes())
    if not isinstance(watermark, dict):
        raise ValueError(f"{path}: a watermark is a JSON object, got {type(watermark).__name__}")
    return watermark


def write_watermark(path: Path, watermark: dict[str, Any]) -> None:
    """Replace the object whole, as the store writes: a crash leaves the old or the new,
    and a temporary file left behind is one the store's listings already skip."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=localbucket.TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(json.dumps(watermark, separators=(",", ":")).encode())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
