"""Writing archived samples out for a trainer: JSON lines or Parquet.

Both formats carry the same columns (``samples_archive.ARCHIVE_FIELDS``). Parquet gets
an explicit schema so that an empty export, or one whose rewards are all null, still
has the right column types; logprobs stay float64 (the archive's exact values).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal

import orjson

from pipeline.samples.archive import ARCHIVE_FIELDS, ArchiveContents, record_sample
from topics.records import TrainingSample

ExportFormat = Literal["jsonl", "parquet"]


class ExportReadError(ValueError):
    """A line or row of an export that is not a sample, named by its number and field."""


FORMATS: tuple[ExportFormat, ...] = ("jsonl", "parquet")


def export_row(record: dict[str, Any]) -> dict[str, Any]:
    """The exported object: the archive fields, in a fixed order (a line archived before
    samples had keys of their own is keyed by its rollout id), then ``unreplayable``:
    whether a call of the sample applied an option no trainer can replay (DESIGN §4.7).
    Every span has ``sampling``: its non-neutral options ({} when neutral), or null when unknown."""
    row = {name: record.get(name) for name in ARCHIVE_FIELDS}
    row["sample_key"] = row["sample_key"] or row["rollout_id"]
    spans = [{**span, "sampling": span.get("sampling")} for span in record.get("spans") or ()]
    row["spans"] = spans
    row["unreplayable"] = any("unreplayable" in (span["sampling"] or {}) for span in spans)
    return row


def write_jsonl(records: Sequence[dict[str, Any]], stream: IO[bytes]) -> int:
    """One JSON object per line; returns the number written."""
    for record in records:
        stream.write(orjson.dumps(export_row(record)) + b"\n")
    stream.flush()
    return len(records)


def write_export(records: Sequence[dict[str, Any]], format: ExportFormat, out: Path | None) -> int:
    """``records`` into ``out`` (None: stdout, JSON lines only) in ``format``; the count written."""
    if format == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file")
        return write_parquet(records, out)
    if out is None:
        return _to_stdout(records)
    with out.open("wb") as handle:
        return write_jsonl(records, handle)


def _to_stdout(records: Sequence[dict[str, Any]]) -> int:
    """JSON lines on stdout; a reader that stops early (``| head``) is not an error."""
    try:
        return write_jsonl(records, sys.stdout.buffer)
    except BrokenPipeError:
        # Keep Python from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return len(records)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return len(records)
        raise


def export_summary(
    source: Path, format: ExportFormat, out: Path | None, count: int, contents: ArchiveContents
) -> dict[str, Any]:
    """What an export wrote, and what it left out of the archive (``--json``)."""
    return {
        "archive": str(source),
        "format": format,
        "out": str(out),
        "samples": count,
        "runs": contents.runs,
        "skipped_lines": contents.skipped_lines,
        "duplicates_dropped": contents.duplicates,
    }


def parquet_schema() -> Any:
    import pyarrow as pa

    sampling = pa.struct(
        [
            ("temperature", pa.float64()),
            ("top_p", pa.float64()),
            ("top_k", pa.int64()),
            ("min_p", pa.float64()),
            ("repetition_penalty", pa.float64()),
            ("frequency_penalty", pa.float64()),
            ("presence_penalty", pa.float64()),
            ("min_tokens", pa.int64()),
            ("logit_bias", pa.list_(pa.struct([("token_id", pa.string()), ("bias", pa.float64())]))),
            ("allowed_token_ids", pa.list_(pa.int64())),
            ("bad_words", pa.list_(pa.string())),
            ("unreplayable", pa.list_(pa.string())),
        ]
    )
    span = pa.struct(
        [
            ("call_id", pa.string()),
            ("start", pa.int64()),
            ("carry_len", pa.int64()),
            ("gen_len", pa.int64()),
            ("reward", pa.float64()),
            ("sampling", sampling),
        ]
    )
    return pa.schema(
        [
            ("run_id", pa.string()),
            ("rollout_id", pa.string()),
            ("sample_key", pa.string()),
            ("group_id", pa.string()),
            ("token_ids", pa.list_(pa.int64())),
            ("token_mask", pa.list_(pa.float32())),
            ("logprobs", pa.list_(pa.float64())),
            ("weight_versions", pa.list_(pa.int64())),
            ("reward", pa.float64()),
            ("cumulative_hash", pa.string()),
            ("spans", pa.list_(span)),
            ("unreplayable", pa.bool_()),
        ]
    )


def _columnar(row: dict[str, Any]) -> dict[str, Any]:
    """The row with each logit bias as a list of ``{token_id, bias}`` (a map has no
    ``datasets`` type); ``SamplingProvenance`` reads that form back."""
    for span in row["spans"]:
        bias = (span["sampling"] or {}).get("logit_bias")
        if bias is not None:
            span["sampling"] = {
                **span["sampling"],
                "logit_bias": [{"token_id": token, "bias": value} for token, value in bias.items()],
            }
    return row


def write_parquet(records: Sequence[dict[str, Any]], path: Path) -> int:
    """A Parquet file with one row per sample; returns the number written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_columnar(export_row(record)) for record in records]
    table = pa.Table.from_pylist(rows, schema=parquet_schema())
    pq.write_table(table, path)
    return len(records)


def read_export(path: Path) -> list[TrainingSample]:
    """The samples of a JSON-lines export or archive, or of a Parquet export (by suffix),
    validated again (``record_sample``). Raises ``ExportReadError`` naming the first bad row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    else:
        records = []
        with path.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise ExportReadError(f"{path}:{number}: not JSON ({exc})") from None
    samples = []
    for number, record in enumerate(records, start=1):
        try:
            samples.append(record_sample(record))
        except (KeyError, ValueError) as exc:
            raise ExportReadError(f"{path}: sample {number}: {exc}") from None
    return samples
