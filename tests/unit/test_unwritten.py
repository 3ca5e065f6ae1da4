"""Giving back offsets a killed durable broker claimed but never wrote (``pipeline.kafka.embedded.unwritten``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.kafka.embedded.unwritten import GivenBack, give_back_unwritten, written_end


def batch_header(records: int) -> bytes:
    """A record batch's first 27 bytes as tansu stores them: base offset 0, then length,
    leader epoch, magic 2, CRC, attributes, and the last offset's delta."""
    return (
        (0).to_bytes(8, "big")
        + (100).to_bytes(4, "big")
        + b"\xff\xff\xff\xff\x02"
        + b"\x12\x34\x56\x78"
        + b"\x00\x00"
        + (records - 1).to_bytes(4, "big")
    )


def partition(
    cluster: Path, topic: str, number: int, batches: dict[int, int], watermark: dict[str, object]
) -> Path:
    """A partition folder: ``batches`` maps each batch's first offset to its record count."""
    folder = cluster / "topics" / topic / "partitions" / f"{number:010d}"
    (folder / "records").mkdir(parents=True)
    for base, records in batches.items():
        (folder / "records" / f"{base:020d}.batch").write_bytes(batch_header(records) + b"rest")
    (folder / "watermark.json").write_text(json.dumps(watermark, separators=(",", ":")))
    return folder


def test_a_watermark_past_the_last_batch_goes_back_to_its_end(tmp_path: Path) -> None:
    holed = partition(
        tmp_path, "t.committed", 2, {0: 1, 1: 3, 4: 2}, {"low": None, "high": 8, "timestamps": None}
    )
    whole = partition(tmp_path, "t.committed", 0, {0: 1, 1: 1}, {"low": None, "high": 2, "timestamps": None})
    untouched = (whole / "watermark.json").read_bytes()

    assert give_back_unwritten(tmp_path) == [GivenBack("t.committed", 2, written_end=6, claimed_end=8)]
    assert json.loads((holed / "watermark.json").read_text()) == {"low": None, "high": 6, "timestamps": None}
    assert (whole / "watermark.json").read_bytes() == untouched
    assert give_back_unwritten(tmp_path) == []  # nothing left to give back
    assert sorted(path.name for path in holed.iterdir()) == ["records", "watermark.json"]  # no file left over


def test_no_batch_at_all_goes_back_to_the_log_start(tmp_path: Path) -> None:
    empty = partition(tmp_path, "t.seal", 1, {}, {"low": None, "high": 1, "timestamps": None})
    started = partition(tmp_path, "t.seal", 3, {}, {"low": 5, "high": 7, "timestamps": None})
    assert give_back_unwritten(tmp_path) == [GivenBack("t.seal", 1, 0, 1), GivenBack("t.seal", 3, 5, 7)]
    assert json.loads((empty / "watermark.json").read_text())["high"] == 0
    assert json.loads((started / "watermark.json").read_text())["high"] == 5


def test_a_temporary_file_beside_the_batches_is_not_a_batch(tmp_path: Path) -> None:
    folder = partition(tmp_path, "t.staged", 0, {0: 2}, {"low": None, "high": 2, "timestamps": None})
    (folder / "records" / ".localbucket-abc").write_bytes(b"half a write")
    assert written_end(folder / "records") == 2
    assert give_back_unwritten(tmp_path) == []


def test_a_batch_shorter_than_its_header_is_an_error_naming_it(tmp_path: Path) -> None:
    folder = partition(tmp_path, "t.staged", 0, {0: 2}, {"low": None, "high": 5, "timestamps": None})
    (folder / "records" / f"{2:020d}.batch").write_bytes(b"\x00" * 10)
    with pytest.raises(
        ValueError, match=r"00000000000000000002\.batch: a record batch shorter than its header"
    ):
        give_back_unwritten(tmp_path)
    assert json.loads((folder / "watermark.json").read_text())["high"] == 5  # left as it was


def test_a_watermark_that_is_not_an_object_is_an_error_naming_it(tmp_path: Path) -> None:
    folder = partition(tmp_path, "t.staged", 0, {0: 2}, {"low": None, "high": 2, "timestamps": None})
    (folder / "watermark.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"watermark\.json: a watermark is a JSON object, got list"):
        give_back_unwritten(tmp_path)
