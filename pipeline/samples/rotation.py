"""``tokentrail samples archive``: accepted samples copied from the data plane into rotated files.

For deployments without ``tokentrail run`` (whose archive only covers its own
rollouts): a long-lived consumer of ``tokentrail.finalized`` in a group of its own
(``tokentrail-archive``) fetches each accepted sample and appends it, in the export
format plus ``run_id`` (``--label``), to ``OUT/samples-{UTC time}-{n}.jsonl`` or
``.parquet``. A file is closed (fsync'd) and a new one begun after ``rotate_records``
samples or ``rotate_s`` seconds. Offsets are committed only past what is on disk: JSON
lines after every batch, Parquet when its file is written. A crash therefore repeats
the samples after the last commit in the next file (``samples export`` and
``read_archive`` keep the first copy per sample key); a sample deleted from the data
plane before it was archived (a trainer acknowledged it) is skipped and counted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from pipeline.process.flags import Flag
from pipeline.samples.archive import sample_record
from pipeline.samples.export import ExportFormat, export_row, write_parquet
from stages.ports import Consumed, DataPlane, TopicPartition, read_samples
from topics.records import FinalizedEvent, TrainingSample

log = logging.getLogger(__name__)

ARCHIVE_GROUP = "tokentrail-archive"


class RotationSettings(BaseModel):
    """Where the files go and when each is closed; each field is a ``tokentrail samples
    archive`` flag (``pipeline.process.flags``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    out_dir: Annotated[Path, Flag("--out", metavar="DIR")]
    """directory for the files"""
    format: ExportFormat = "jsonl"
    """file format"""
    rotate_records: Annotated[int, Field(ge=1)] = 10_000
    """samples per file at most"""
    rotate_s: Annotated[float, Field(gt=0), Flag("--rotate-seconds")] = 3600.0
    """seconds a file stays open at most"""
    label: str = "cluster"
    """the run_id every archived record carries"""


@dataclass(slots=True)
class ArchiveStats:
    written: int = 0
    files: int = 0
    missing: int = 0


class RotatingArchive:
    """A ``StageHandler`` for the consumer loop: samples of accepted events into rotated files."""

    def __init__(self, data_plane: DataPlane, settings: RotationSettings, clock: Any = time.time) -> None:
        self.data_plane = data_plane
        self.settings = settings
        self.stats = ArchiveStats()
        self._clock = clock
        self._handle: IO[bytes] | None = None
        self._opened_at = 0.0
        self._in_file = 0
        self._buffered: list[dict[str, Any]] = []
        self._positions: dict[TopicPartition, int] = {}
        self._durable: dict[TopicPartition, int] = {}
        settings.out_dir.mkdir(parents=True, exist_ok=True)

    async def handle(self, batch: Sequence[Consumed]) -> None:
        events = [item.event.payload for item in batch if isinstance(item.event.payload, FinalizedEvent)]
        for sample in await self._fetch([key for event in events for key in event.sample_keys]):
            self._append(sample_record(sample, self.settings.label))
        for item in batch:
            self._positions[(item.topic, item.partition)] = item.offset + 1
        if self.settings.format == "jsonl":
            self._sync()
            self._durable.update(self._positions)
        if self._due():
            self.rotate()

    async def tick(self, now: float) -> None:
        del now
        if self._due():
            self.rotate()

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        del positions  # only what is on disk
        return dict(self._durable)

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        self.rotate()  # what this member wrote is on disk before another takes over
        for partition in partitions:
            self._positions.pop(partition, None)
            self._durable.pop(partition, None)

    def rotate(self) -> None:
        """Close the current file (written and fsync'd) so the next sample starts a new one."""
        if self.settings.format == "parquet" and self._buffered:
            path = self._new_path()
            write_parquet(self._buffered, path)
            _fsync(path)
            self._buffered = []
        if self._handle is not None:
            self._sync()
            self._handle.close()
            self._handle = None
        self._durable.update(self._positions)
        self._in_file = 0

    async def _fetch(self, keys: list[str]) -> list[TrainingSample]:
        found, gone = await read_samples(self.data_plane, keys)
        if gone:
            self.stats.missing += len(gone)
            log.warning("%d sample(s) no longer in the data plane: not archived", len(gone))
        return [found[key] for key in keys if key in found]

    def _append(self, record: dict[str, Any]) -> None:
        if self._in_file == 0:
            self._opened_at = self._clock()
        if self.settings.format == "parquet":
            self._buffered.append(record)
        else:
            if self._handle is None:
                self._handle = self._new_path().open("ab")
            self._handle.write(orjson.dumps(export_row(record)) + b"\n")
        self._in_file += 1
        self.stats.written += 1

    def _due(self) -> bool:
        if self._in_file == 0:
            return False
        return (
            self._in_file >= self.settings.rotate_records
            or self._clock() - self._opened_at >= self.settings.rotate_s
        )

    def _new_path(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self._clock()))
        self.stats.files += 1
        return self.settings.out_dir / f"samples-{stamp}-{self.stats.files:05d}.{self.settings.format}"

    def _sync(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
