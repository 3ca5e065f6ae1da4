"""The long-lived sample archive: rotated files, commits only past what is on disk."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.samples.archive import read_archive
from pipeline.samples.rotation import RotatingArchive, RotationSettings
from stages.memory import MemoryDataPlane
from stages.ports import Consumed
from topics import digest
from topics.events import envelope
from topics.records import FinalizedEvent, TrainingSample


def sample(rollout_id: str) -> TrainingSample:
    ids = [10, 11, 12]
    return TrainingSample.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": "g",
            "token_ids": ids,
            "token_mask": [0.0, 1.0, 1.0],
            "logprobs": [0.0, -0.5, -0.5],
            "weight_versions": [0, 0, 0],
            "spans": [{"call_id": "c1", "start": 0, "carry_len": 1, "gen_len": 2}],
            "reward": 1.0,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def finalized(rollout_id: str, accepted: bool = True) -> FinalizedEvent:
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "status": "accepted" if accepted else "rejected",
        "prompt_len": 1,
        "total_len": 3,
        "generated_tokens": 2,
        "call_count": 1,
        "finalized_at": 1.0,
    }
    fields.update({"sample_key": rollout_id} if accepted else {"rejection_reason": "missing_row"})
    return FinalizedEvent.model_validate(fields)


def batch(events: list[FinalizedEvent], start: int) -> list[Consumed]:
    return [Consumed("fin", 0, start + i, envelope(e)) for i, e in enumerate(events)]


def test_jsonl_files_rotate_and_commits_follow_the_disk(tmp_path: Path) -> None:
    async def go() -> RotatingArchive:
        plane = MemoryDataPlane()
        await plane.put_samples([sample(f"r{i}") for i in range(5) if i != 3])  # r3's is gone
        archive = RotatingArchive(plane, RotationSettings(out_dir=tmp_path, rotate_records=2))
        await archive.handle(batch([finalized("r0"), finalized("r1"), finalized("x", accepted=False)], 0))
        assert archive.committable({("fin", 0): 3}) == {("fin", 0): 3}
        await archive.handle(batch([finalized("r2"), finalized("r3"), finalized("r4")], 3))
        archive.rotate()
        return archive

    archive = asyncio.run(go())
    files = sorted(tmp_path.glob("samples-*.jsonl"))
    assert [len(f.read_text().splitlines()) for f in files] == [2, 2]
    assert archive.stats.written == 4 and archive.stats.missing == 1
    records = [r for f in files for r in read_archive(f).records]
    assert [r["rollout_id"] for r in records] == ["r0", "r1", "r2", "r4"]
    assert (records[0]["run_id"], records[0]["sample_key"]) == ("cluster", "r0")
    assert json.loads(files[0].read_text().splitlines()[0])["token_ids"] == [10, 11, 12]


def test_parquet_is_committed_only_once_its_file_is_written(tmp_path: Path) -> None:
    async def go() -> None:
        plane = MemoryDataPlane()
        await plane.put_samples([sample("r0"), sample("r1")])
        archive = RotatingArchive(
            plane, RotationSettings(out_dir=tmp_path, format="parquet", rotate_records=10)
        )
        await archive.handle(batch([finalized("r0"), finalized("r1")], 0))
        assert archive.committable({("fin", 0): 2}) == {}
        archive.rotate()
        assert archive.committable({("fin", 0): 2}) == {("fin", 0): 2}

    asyncio.run(go())
    (written,) = tmp_path.glob("samples-*.parquet")  # nothing was written before the rotation
    assert [r["rollout_id"] for r in pq.read_table(written).to_pylist()] == ["r0", "r1"]
