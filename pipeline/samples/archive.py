"""The durable copy of accepted samples: ``DATA_DIR/samples.jsonl``.

TransferQueue keeps rows in memory: when the process owning the embedded data plane
exits, every sample in it is gone. ``tokentrail run`` therefore appends each accepted
sample of the run, fetched back from the data plane once its ``FinalizedEvent``
arrives, to this archive; ``tokentrail samples export`` reads it. One JSON object per
line, in the export format (DESIGN §10) plus ``run_id``, ``cumulative_hash`` (the
verified hash of the sample's ids) and ``spans`` (where each call lies).

Lines are appended whole and flushed per sample, so an interrupted run keeps every
sample archived before the interruption; a torn last line (a crash mid-write) is
skipped and counted by the reader.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import orjson

from topics.records import CallSpan, TrainingSample

ARCHIVE_NAME = "samples.jsonl"

# The DESIGN §10 export fields, then what the archive adds.
EXPORT_FIELDS = (
    "rollout_id",
    "sample_key",
    "group_id",
    "token_ids",
    "token_mask",
    "logprobs",
    "weight_versions",
    "reward",
)
ARCHIVE_FIELDS = ("run_id", *EXPORT_FIELDS, "cumulative_hash", "spans")


def archive_path(data_dir: Path) -> Path:
    return data_dir / ARCHIVE_NAME


def sample_record(sample: TrainingSample, run_id: str) -> dict[str, Any]:
    """The archive (and export) object of one sample."""
    return {
        "run_id": run_id,
        "rollout_id": sample.rollout_id,
        "sample_key": sample.key,
        "group_id": sample.group_id,
        "token_ids": list(sample.token_ids),
        "token_mask": list(sample.token_mask),
        "logprobs": list(sample.logprobs),
        "weight_versions": list(sample.weight_versions),
        "reward": sample.reward,
        "cumulative_hash": sample.cumulative_hash,
        "spans": [span_record(span) for span in sample.spans],
    }


def span_record(span: CallSpan) -> dict[str, Any]:
    """A span as the archive keeps it: ``sampling`` only when given, and only its
    non-neutral options (DESIGN §4.7)."""
    record = span.model_dump(mode="json", exclude={"schema_version", "sampling"})
    if span.sampling is not None:
        record["sampling"] = span.sampling.extras()
    return record


def record_sample(record: Mapping[str, Any]) -> TrainingSample:
    """The sample an archive or export record (a JSON line, a Parquet or ``datasets`` row) holds,
    validated again: the inverse of ``sample_record``."""
    fields = {name: record[name] for name in ARCHIVE_FIELDS if name != "run_id"}
    if fields["sample_key"] == fields["rollout_id"]:  # a rollout's only sample is stored under its id
        fields["sample_key"] = None
    return TrainingSample.model_validate(fields)


class SampleArchive:
    """Appends sample records to the archive file; ``written`` counts this writer's lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0
        self._file: IO[bytes] | None = None

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()
        self.written += 1

    def close(self) -> None:
        """Flush to disk (fsync) and close; idempotent."""
        handle, self._file = self._file, None
        if handle is not None:
            os.fsync(handle.fileno())
            handle.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(slots=True)
class ArchiveContents:
    """Records read from an archive, once per sample key, and what had to be skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0
    duplicates: int = 0

    @property
    def runs(self) -> list[str]:
        return sorted({str(record["run_id"]) for record in self.records})


def read_archive(path: Path, *, run_id: str | None = None) -> ArchiveContents:
    """Every archived sample (of ``run_id`` if given), the first line per sample key winning
    (lines archived before samples had keys of their own are keyed by their rollout id).

    A missing archive reads as empty: no run has accepted a sample there yet.
    """
    contents = ArchiveContents()
    seen: set[str] = set()
    for record in _lines(path, contents):
        if run_id is not None and record.get("run_id") != run_id:
            continue
        key = str(record.get("sample_key") or record["rollout_id"])
        if key in seen:
            contents.duplicates += 1
            continue
        seen.add(key)
        contents.records.append(record)
    return contents


def _lines(path: Path, contents: ArchiveContents) -> Iterator[dict[str, Any]]:
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return
    with handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                contents.skipped_lines += 1
                continue
            if not isinstance(record, dict) or "rollout_id" not in record or "run_id" not in record:
                contents.skipped_lines += 1
                continue
            yield record
