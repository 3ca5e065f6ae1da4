"""Packing's rule and its record batches (``pipeline.kafka.embedded.packing``); the broker
reading packs back is ``tests/integration/test_embedded_packing.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka.record.default_records import DefaultRecordBatch
from batchkit import TIMESTAMP_MS, record_batch

from pipeline.kafka.embedded.packing import NotPackable, drop_replaced, packed_batch, plan_packs
from pipeline.kafka.embedded.unwritten import StoredBatch

OLD, NOW = 100.0, 1000.0


def stored(base: int, size: int = 10, written_at: float = OLD) -> StoredBatch:
    return StoredBatch(base, size, written_at, Path(f"{base:020d}.batch"))


def bases(runs: list[list[StoredBatch]]) -> list[list[int]]:
    return [[batch.base for batch in run] for run in runs]


def test_every_old_batch_but_the_newest_goes_into_one_pack() -> None:
    assert bases(plan_packs([stored(0), stored(1), stored(2), stored(3)], NOW)) == [[0, 1, 2]]


def test_a_young_or_large_batch_splits_the_runs_and_a_run_of_one_stays() -> None:
    batches = [
        stored(0),
        stored(1),
        stored(2, written_at=NOW),
        stored(3),
        stored(4),
        stored(5, size=60),
        stored(6),
    ]
    assert bases(plan_packs(batches, NOW, pack_bytes=100)) == [[0, 1], [3, 4]]
    assert plan_packs([stored(0), stored(1, written_at=NOW), stored(2)], NOW) == []


def test_a_run_closes_before_it_passes_the_pack_size() -> None:
    batches = [stored(offset, size=30) for offset in range(8)]
    assert bases(plan_packs(batches, NOW, pack_bytes=100)) == [[0, 1, 2], [3, 4, 5]]  # 6: alone; 7: newest


def test_a_pack_holds_every_record_at_its_offset_with_its_time_key_value_and_headers() -> None:
    pack = DefaultRecordBatch(
        packed_batch([(5, record_batch(5, 1)), (6, record_batch(6, 3)), (9, record_batch(9, 2))])
    )
    assert pack.validate_crc() and pack.base_offset == 5 and pack.next_offset == 11
    records = [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in pack]
    assert records == [
        (
            offset,
            TIMESTAMP_MS + offset,
            f"k{offset}".encode(),
            f"v{offset}".encode(),
            [("n", str(offset).encode())],
        )
        for offset in range(5, 11)
    ]


def test_batches_that_do_not_follow_each_other_or_fail_their_checksum_are_not_packed() -> None:
    with pytest.raises(NotPackable, match="does not follow"):
        packed_batch([(0, record_batch(0, 2)), (3, record_batch(3, 1))])
    damaged = bytearray(record_batch(1, 1))
    damaged[-1] ^= 0xFF
    with pytest.raises(NotPackable, match="checksum"):
        packed_batch([(0, record_batch(0, 1)), (1, bytes(damaged))])


def test_batches_a_pack_already_holds_are_dropped_before_the_store_serves(tmp_path: Path) -> None:
    """A store killed after writing a pack and before deleting what it replaced: the copies go."""
    records = tmp_path / "tansu/clusters/c/topics/t/partitions/0000000000/records"
    records.mkdir(parents=True)
    pack = packed_batch([(0, record_batch(0, 1)), (1, record_batch(1, 2)), (3, record_batch(3, 1))])
    for base, data in {0: pack, 1: record_batch(1, 2), 3: record_batch(3, 1), 4: record_batch(4, 1)}.items():
        (records / f"{base:020d}.batch").write_bytes(data)
    assert drop_replaced(tmp_path) == 2
    assert sorted(path.name for path in records.iterdir()) == [f"{0:020d}.batch", f"{4:020d}.batch"]
    assert drop_replaced(tmp_path) == 0
