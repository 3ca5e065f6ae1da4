"""A copy of a live durable store (``pipeline.kafka.embedded.snapshot``): each partition's
batches copied whole, one torn by the store's upkeep copied again."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchkit import record_batch

from pipeline.kafka.embedded import snapshot
from pipeline.kafka.embedded.snapshot import TornCopy, copy_store, whole

RECORDS = "tansu/clusters/c/topics/t/partitions/0000000000/records"


def partition(root: Path, batches: dict[int, int]) -> Path:
    """A partition holding a batch of ``count`` records at each ``base``."""
    records = root / RECORDS
    records.mkdir(parents=True)
    (records.parent / "watermark.json").write_text("{}")
    for base, count in batches.items():
        (records / f"{base:020d}.batch").write_bytes(record_batch(base, count))
    return records


@pytest.mark.parametrize(
    ("batches", "is_whole"),
    [
        ({0: 1, 1: 2, 3: 1}, True),
        ({5: 3}, True),  # a log that starts past 0 (retention took the rest)
        ({0: 4, 1: 2}, False),  # a pack and a batch it replaced
        ({0: 1, 2: 1}, False),  # a gap
    ],
)
def test_a_partition_is_whole_when_each_batch_ends_where_the_next_begins(
    tmp_path: Path, batches: dict[int, int], is_whole: bool
) -> None:
    assert whole(partition(tmp_path, batches)) is is_whole


def test_a_partition_torn_in_the_copy_is_copied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    partition(store, {0: 1, 1: 2, 3: 1})
    copied = snapshot._copy_if_there
    skipped: list[str] = []

    def deleted_once(source: str, destination: str) -> None:
        """The batch at 1 vanishes from the first copy, as one being packed would."""
        if source.endswith(f"{1:020d}.batch") and not skipped:
            skipped.append(source)
            return
        copied(source, destination)

    monkeypatch.setattr(snapshot, "_copy_if_there", deleted_once)
    copy_store(store, tmp_path / "copy")
    assert skipped and whole(tmp_path / "copy" / RECORDS)
    assert sorted(path.name for path in (tmp_path / "copy" / RECORDS).iterdir()) == sorted(
        path.name for path in (store / RECORDS).iterdir()
    )


def test_a_partition_that_never_copies_whole_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    partition(store, {0: 1, 2: 1})
    with pytest.raises(TornCopy, match="changed under every copy"):
        copy_store(store, tmp_path / "copy")
