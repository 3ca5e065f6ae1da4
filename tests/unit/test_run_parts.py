"""The engine-free parts of ``tokentrail run``: planning, the archive, export, outcomes.

The end-to-end behaviour is in tests/integration/test_run_e2e.py (a minute per run);
these pin the pieces that decide which rollouts a run owns, what is archived and
exported, and how an interruption still seals what was in flight.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import MEMORY_LOG_MARGIN_MS, EmbeddedBroker
from pipeline.run.archiver import SampleArchiver
from pipeline.run.config import RunConfig, new_run_id, plan_jobs
from pipeline.run.driver import SealTrackingClient, play_jobs
from pipeline.run.finalized_watch import FinalizedWatcher
from pipeline.run.journal import INTERRUPTED, RunJournal, close_dead_runs, dead_runs
from pipeline.run.services import RUN_GROUPS, run_groups
from pipeline.samples.archive import SampleArchive, read_archive, sample_record
from pipeline.samples.export import export_row, write_jsonl, write_parquet
from stages.client import RolloutClient
from stages.driver import RolloutDriver
from stages.memory import MemoryDataPlane, RecordingSink
from topics import digest
from topics.codec import encode
from topics.events import envelope
from topics.records import IDENT_PATTERN, FinalizedEvent, RolloutSeal, TrainingSample


def sample(rollout_id: str, n: int = 5, reward: float | None = 1.0) -> TrainingSample:
    ids = list(range(10, 10 + n))
    return TrainingSample.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": rollout_id.rsplit(".", 1)[0],
            "token_ids": ids,
            "token_mask": [0.0, 0.0] + [1.0] * (n - 2),
            "logprobs": [0.0, 0.0] + [-0.5] * (n - 2),
            "weight_versions": [0] * n,
            "spans": [{"call_id": "c1", "start": 0, "carry_len": 2, "gen_len": n - 2}],
            "reward": reward,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def finalized(rollout_id: str, status: str = "accepted") -> FinalizedEvent:
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "status": status,
        "prompt_len": 2,
        "total_len": 5,
        "generated_tokens": 3,
        "call_count": 1,
        "finalized_at": time.time(),
    }
    if status == "accepted":
        fields["sample_key"] = rollout_id
    else:
        fields.update(rejection_reason="missing_row", prompt_len=0, total_len=0, generated_tokens=0)
    return FinalizedEvent.model_validate(fields)


def test_jobs_are_groups_of_one_task_with_run_scoped_ids() -> None:
    run_id = new_run_id()
    jobs = plan_jobs(run_id, rollouts=8, group_size=4, seed=0)
    assert len(jobs) == 8 and len({job.rollout_id for job in jobs}) == 8
    assert all(re.fullmatch(IDENT_PATTERN, job.rollout_id) for job in jobs)
    groups: dict[str, set[str]] = {}
    for job in jobs:
        assert job.rollout_id.startswith(job.group_id + ".") and job.group_id.startswith(run_id + ".")
        groups.setdefault(job.group_id, set()).add(job.task.expression)
    assert len(groups) == 2 and all(len(tasks) == 1 for tasks in groups.values())
    assert not {j.rollout_id for j in jobs} & {
        j.rollout_id for j in plan_jobs(new_run_id(), rollouts=8, group_size=4, seed=0)
    }


@pytest.mark.parametrize(
    "bad",
    [{"rollouts": 6, "group_size": 4}, {"turns": 0}, {"temperature": -1.0}, {"lag_timeout_s": 0.0}],
)
def test_config_refuses_what_cannot_run(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RunConfig(**bad)


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"train_steps": 2, "max_staleness": -1}, "max_staleness"),
        ({"train_steps": 2, "staleness_measure": "middle"}, "staleness_measure"),
        ({"train_steps": 2, "trainer_delay_s": -1.0}, "trainer_delay_s"),
        ({"trainer_delay_s": 1.0}, "trainer_delay_s"),  # nothing to slow down without training
        ({"max_staleness": 1}, "max_staleness"),  # nothing to pace either
        ({"train_steps": 2, "trainer": "trl", "trainer_delay_s": 1.0}, "trainer_delay_s"),
        ({"train_steps": 2, "trainer": "trl", "max_staleness": -1}, "max_staleness"),
    ],
)
def test_config_refuses_bad_pacing_naming_the_field(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=rf"(?m)^(  Value error, )?{named}\b"):
        RunConfig(**bad)


def test_a_paced_job_is_not_admitted_so_a_stop_seals_none_of_those_held() -> None:
    async def go() -> tuple[RecordingSink, list[int]]:
        sink = RecordingSink()
        client = SealTrackingClient(sink)
        driver = RolloutDriver(client, SlowEndpoint(), max_turns=2)
        jobs = plan_jobs("run-p", rollouts=6, group_size=2, seed=0)
        asked: list[int] = []

        async def pace(index: int) -> None:
            asked.append(index)
            if index >= 2:  # the trainer never catches up
                await asyncio.Event().wait()

        task = asyncio.create_task(play_jobs(driver, client, jobs, concurrency=6, pace=pace))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sink, asked

    sink, asked = asyncio.run(go())
    assert sorted(asked) == list(range(6))
    seals = [seal for seal in sink.payloads(RolloutSeal) if isinstance(seal, RolloutSeal)]
    first_two = [job.rollout_id for job in plan_jobs("run-p", rollouts=6, group_size=2, seed=0)[:2]]
    assert sorted(seal.rollout_id for seal in seals) == sorted(first_two), seals


def test_default_model_lives_in_the_data_dir() -> None:
    assert RunConfig(data_dir=Path("d")).resolved_model_dir == Path("d/tiny-model")
    assert RunConfig(model_dir=Path("m")).resolved_model_dir == Path("m")
    assert RunConfig().embedded_broker and not RunConfig(kafka=KafkaConfig("k:9092")).embedded_broker


def test_archive_keeps_one_record_per_rollout_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    with SampleArchive(path) as archive:
        archive.append(sample_record(sample("run-a.t.0"), "run-a"))
        archive.append(sample_record(sample("run-a.t.0"), "run-a"))  # a repeat never counts twice
    with SampleArchive(path) as archive:  # a second run appends
        archive.append(sample_record(sample("run-b.t.0", reward=None), "run-b"))
    with path.open("ab") as handle:
        handle.write(b'{"run_id": "run-b", "rollout_id": "run-b.t.1", "tok')  # killed mid-write
    contents = read_archive(path)
    assert [r["rollout_id"] for r in contents.records] == ["run-a.t.0", "run-b.t.0"]
    assert contents.duplicates == 1 and contents.skipped_lines == 1
    assert contents.runs == ["run-a", "run-b"]
    assert [r["rollout_id"] for r in read_archive(path, run_id="run-b").records] == ["run-b.t.0"]
    assert read_archive(tmp_path / "absent.jsonl").records == []


def test_export_carries_the_design_fields_in_both_formats(tmp_path: Path) -> None:
    records = [
        sample_record(sample("run-a.t.0"), "run-a"),
        sample_record(sample("run-a.t.1", 7, None), "run-a"),
    ]
    with (tmp_path / "out.jsonl").open("wb") as handle:
        assert write_jsonl(records, handle) == 2
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    required = {"rollout_id", "group_id", "token_ids", "token_mask", "logprobs", "weight_versions", "reward"}
    assert all(required | {"run_id"} <= line.keys() for line in lines)
    assert lines[0]["spans"] == [
        {"call_id": "c1", "start": 0, "carry_len": 2, "gen_len": 3, "reward": None, "sampling": None}
    ]
    assert write_parquet(records, tmp_path / "out.parquet") == 2
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.to_pylist() == [export_row(record) for record in records]
    assert write_parquet([], tmp_path / "empty.parquet") == 0
    assert pq.read_table(tmp_path / "empty.parquet").schema.names == table.schema.names


def test_watcher_keeps_the_first_outcome_of_its_own_rollouts_only() -> None:
    seen: list[str] = []
    watcher = FinalizedWatcher(
        KafkaConfig("k:9092"), ["r.1", "r.2"], on_event=lambda e: seen.append(e.rollout_id)
    )
    for event in [
        finalized("old.1"),
        finalized("r.1"),
        finalized("r.1", "rejected"),
        finalized("r.2", "rejected"),
    ]:
        key, value, headers = encode(envelope(event))
        watcher.offer(key, value, headers)
    watcher.offer(b"r.1", b"not json", [])
    assert seen == ["r.1", "r.2"] and watcher.complete.is_set()
    assert [e.rollout_id for e in watcher.accepted] == ["r.1"]
    assert watcher.rejected == {"missing_row": 1} and watcher.repeats == 1 and watcher.undecodable == 1


def test_archiver_fetches_accepted_samples_and_survives_a_failed_fetch(tmp_path: Path) -> None:
    async def go() -> tuple[SampleArchiver, list[dict[str, Any]]]:
        plane = MemoryDataPlane()
        await plane.put_samples([sample("r.1"), sample("r.3")])
        watcher = FinalizedWatcher(KafkaConfig("k:9092"), ["r.1", "r.2", "r.3", "r.4"])
        for event in [finalized("r.1"), finalized("r.2", "rejected"), finalized("r.4"), finalized("r.3")]:
            watcher.offer(*encode(envelope(event)))
        watcher.end()  # what follow() does when it stops
        with SampleArchive(tmp_path / "s.jsonl") as archive:
            archiver = SampleArchiver(plane, archive, "run-x")
            await archiver.run(watcher.stream)
        return archiver, read_archive(tmp_path / "s.jsonl").records

    archiver, records = asyncio.run(go())
    assert [r["rollout_id"] for r in records] == ["r.1", "r.3"]  # r.4's sample is missing
    assert archiver.written == 2 and len(archiver.failed) == 1 and archiver.tokens == 10
    assert all(r["run_id"] == "run-x" for r in records)


def test_a_rollout_with_several_samples_is_archived_once_per_sample(tmp_path: Path) -> None:
    branches = [sample("r.1").model_copy(update={"sample_key": f"r.1@c{i}"}) for i in (1, 2)]
    event = FinalizedEvent.model_validate(
        {
            **finalized("r.1").model_dump(exclude={"sample_key", "schema_version"}),
            "sample_policy": "leaves",
            "samples": [
                {"sample_key": "r.1@c1", "leaf_call_id": "c1", "status": "accepted"},
                {
                    "sample_key": "r.1@c3",
                    "leaf_call_id": "c3",
                    "status": "rejected",
                    "rejection_reason": "missing_row",
                },
                {"sample_key": "r.1@c2", "leaf_call_id": "c2", "status": "accepted"},
            ],
        }
    )

    async def go() -> SampleArchiver:
        plane = MemoryDataPlane()
        await plane.put_samples(branches)
        watcher = FinalizedWatcher(KafkaConfig("k:9092"), ["r.1"])
        watcher.offer(*encode(envelope(event)))
        watcher.end()
        with SampleArchive(tmp_path / "s.jsonl") as archive:
            archiver = SampleArchiver(plane, archive, "run-x")
            await archiver.run(watcher.stream)
        return archiver

    assert asyncio.run(go()).written == 2
    records = read_archive(tmp_path / "s.jsonl").records
    assert [(r["rollout_id"], r["sample_key"]) for r in records] == [("r.1", "r.1@c1"), ("r.1", "r.1@c2")]
    old_line = {k: v for k, v in sample_record(sample("r.0"), "run-x").items() if k != "sample_key"}
    assert export_row(old_line)["sample_key"] == "r.0"  # archived before samples had keys


class SlowEndpoint:
    """A chat endpoint that never answers (so every rollout is in flight when stopped)."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def test_an_interrupted_run_seals_its_in_flight_rollouts_once() -> None:
    async def go() -> RecordingSink:
        sink = RecordingSink()
        client = SealTrackingClient(sink)
        driver = RolloutDriver(client, SlowEndpoint(), max_turns=2)
        jobs = plan_jobs("run-z", rollouts=6, group_size=2, seed=0)
        task = asyncio.create_task(play_jobs(driver, client, jobs, concurrency=2))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sink

    sink = asyncio.run(go())
    seals = [seal for seal in sink.payloads(RolloutSeal) if isinstance(seal, RolloutSeal)]
    assert len(seals) == 2  # the two in flight; the four never started were never admitted
    assert all(seal.status == "failed" and seal.failure_reason == INTERRUPTED for seal in seals)
    assert len({seal.rollout_id for seal in seals}) == 2


def _as_dead(journal: RunJournal) -> None:
    """Rewrite the journal's header as if its run's process were gone."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    header, *rest = journal.path.read_text().splitlines()
    dead = {**json.loads(header), "pid": int(gone.stdout)}
    journal.path.write_text("\n".join([json.dumps(dead), *rest]) + "\n")


def test_a_killed_run_is_finished_by_the_next_one_on_the_same_log(tmp_path: Path) -> None:
    """What the journal of a dead run says is open gets sealed ``interrupted``, once."""
    jobs = plan_jobs("run-dead", rollouts=6, group_size=2, seed=0)
    killed = RunJournal(tmp_path, "run-dead", "durable:c1")
    for job in jobs[:3]:
        killed.started(job)
    killed.sealed(jobs[0].rollout_id)
    killed.close()  # two started rollouts are open: the journal stays
    assert killed.path.exists()
    _as_dead(killed)
    elsewhere = RunJournal(tmp_path, "run-memory", "memory:c2")  # its log died with its broker
    elsewhere.started(jobs[3])
    elsewhere.close()
    _as_dead(elsewhere)
    alive = RunJournal(tmp_path, "run-alive", "durable:c1")  # this process: a run still going
    alive.started(jobs[4])
    assert sorted(run.run_id for run in dead_runs(tmp_path)) == ["run-dead", "run-memory"]

    sink = RecordingSink()
    sealed = asyncio.run(close_dead_runs(tmp_path, "durable:c1", RolloutClient(sink)))

    seals = [s for s in sink.payloads(RolloutSeal) if isinstance(s, RolloutSeal)]
    assert sealed == 2 and {s.rollout_id for s in seals} == {jobs[1].rollout_id, jobs[2].rollout_id}
    assert all(s.status == "failed" and s.failure_reason == INTERRUPTED for s in seals)
    assert {s.group_id for s in seals} == {jobs[1].group_id, jobs[2].group_id}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run-alive.jsonl"]
    assert asyncio.run(close_dead_runs(tmp_path, "durable:c1", RolloutClient(sink))) == 0  # once
    alive.sealed(jobs[4].rollout_id)
    alive.close()
    assert not alive.path.exists()  # everything it started was sealed


def test_the_merge_margin_is_short_only_where_the_log_is_fast(tmp_path: Path) -> None:
    """The memory broker logs a record within 100 ms of its stamp; durable storage and an
    external cluster keep the margin that covers their slower writes (DESIGN §7.2)."""
    wait = RunConfig().fetch_wait_ms
    memory = run_groups(EmbeddedBroker(storage="memory"), wait)
    durable = run_groups(EmbeddedBroker(storage="durable", data_dir=tmp_path), wait)
    assert memory.idle_margin_ms == MEMORY_LOG_MARGIN_MS < durable.idle_margin_ms
    assert durable == run_groups(None, wait) == RUN_GROUPS
    assert memory.fetch_wait_ms == RUN_GROUPS.fetch_wait_ms
