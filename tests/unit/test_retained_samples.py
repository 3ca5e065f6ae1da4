"""The finalizer's copies of samples: kept until every owner committed past their outcome,
bounded, and put back into a restarted data plane (DESIGN §7.4)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rowkit import two_calls

from pipeline.samples.spool import DirectorySpool
from stages.finalize.retain import OwnerProgress, RetainedSamples, RetentionConfig, sample_bytes
from stages.memory import MemoryDataPlane


@dataclass
class Owners:
    """Rollouts ``a*`` land on partition 0, the rest on 1; progress is what the test sets."""

    ends: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})
    acknowledged: dict[int, int] = field(default_factory=dict)
    down: bool = False
    reads: int = 0
    pending: list[str] = field(default_factory=list)

    def partition_of(self, rollout_id: str) -> int:
        return 0 if rollout_id.startswith("a") else 1

    async def progress(self) -> OwnerProgress:
        self.reads += 1
        if self.down:
            raise ConnectionError("broker unreachable")
        return OwnerProgress(ends=dict(self.ends), acknowledged=dict(self.acknowledged))

    async def unacknowledged(self) -> list[str]:
        return list(self.pending)


def held_keys(retained: RetainedSamples) -> list[str]:
    plane = MemoryDataPlane()
    asyncio.run(retained.restore(plane))
    return sorted(plane.samples)


def test_a_sample_is_let_go_only_once_its_owner_committed_past_the_end_read_after_it() -> None:
    owners = Owners(ends={0: 5, 1: 3})
    retained = RetainedSamples(owners)
    retained.hold([two_calls("a1", 1.0), two_calls("b1", 0.0)])
    asyncio.run(retained.check())  # marks: a1 at 5 (partition 0), b1 at 3 (partition 1)
    assert len(retained) == 2  # nobody committed yet
    owners.acknowledged = {0: 4, 1: 3}  # partition 0 is one short of the mark
    asyncio.run(retained.check())
    assert held_keys(retained) == ["a1"]
    assert retained.stats.released == 1
    owners.acknowledged = {0: 5, 1: 3}
    asyncio.run(retained.check())
    assert len(retained) == 0 and retained.stats.held_bytes == 0


def test_the_mark_is_the_end_at_the_first_check_so_an_older_commit_never_releases() -> None:
    owners = Owners(ends={0: 10, 1: 0}, acknowledged={0: 9})
    retained = RetainedSamples(owners)
    retained.hold([two_calls("a1", 1.0)])
    asyncio.run(retained.check())
    owners.ends = {0: 20, 1: 0}  # later events do not move a mark already taken
    owners.acknowledged = {0: 10}
    asyncio.run(retained.check())
    assert len(retained) == 0


def test_over_the_budget_the_oldest_go_unread_and_are_counted() -> None:
    one = sample_bytes(two_calls("a1", 1.0))
    retained = RetainedSamples(Owners(), RetentionConfig(budget_bytes=2 * one))
    retained.hold([two_calls("a1", 1.0), two_calls("a2", 1.0), two_calls("a3", 1.0)])
    assert held_keys(retained) == ["a2", "a3"]
    assert retained.stats.over_budget == 1
    assert retained.stats.held_bytes == 2 * one


def test_a_sample_written_again_is_held_once() -> None:
    retained = RetainedSamples(Owners())
    retained.hold([two_calls("a1", 1.0)])
    retained.hold([two_calls("a1", 1.0)])
    assert len(retained) == 1 and retained.stats.held_bytes == sample_bytes(two_calls("a1", 1.0))


def test_restore_puts_back_every_unacknowledged_sample_and_counts_the_restart() -> None:
    owners = Owners(ends={0: 1, 1: 1})
    retained = RetainedSamples(owners)
    retained.hold([two_calls("a1", 1.0)])
    asyncio.run(retained.check())
    owners.acknowledged = {0: 1}
    retained.hold([two_calls("b1", 0.5)])
    plane = MemoryDataPlane()
    asyncio.run(retained.restore(plane))
    assert sorted(plane.samples) == ["b1"]  # a1 was acknowledged: not resurrected
    assert plane.samples["b1"] == two_calls("b1", 0.5)
    assert retained.stats.restored == 1 and retained.restores == 1


def test_a_starting_finalizer_reclaims_the_unacknowledged_samples_still_stored(tmp_path: Path) -> None:
    plane = MemoryDataPlane()
    asyncio.run(plane.put_samples([two_calls("a1", 1.0), two_calls("b1", 0.0), two_calls("c1", 0.0)]))
    spool = DirectorySpool(tmp_path)
    retained = RetainedSamples(Owners(pending=["a1", "b1", "gone"]), spool=spool)  # c1 acknowledged
    asyncio.run(retained.reclaim(plane))
    assert held_keys(retained) == ["a1", "b1"]
    assert sorted(s.key for _, batch in spool.load() for s in batch) == ["a1", "b1"]  # on disk too


def test_copies_on_disk_outlive_the_process_and_go_with_their_last_sample(tmp_path: Path) -> None:
    owners = Owners(ends={0: 3, 1: 3})
    first = RetainedSamples(owners, spool=DirectorySpool(tmp_path))
    batch = [two_calls("a1", 1.0), two_calls("b1", 0.0)]
    first.hold(batch, first.store(batch))
    del first  # the process dies: a new one, on the same directory, after the data plane restarted
    plane = MemoryDataPlane()
    second = RetainedSamples(owners, spool=DirectorySpool(tmp_path))
    asyncio.run(second.reclaim(plane))
    assert sorted(plane.samples) == ["a1", "b1"] and plane.samples["a1"] == batch[0]
    owners.acknowledged = {0: 3}  # a1 acknowledged: its file stays for b1
    asyncio.run(second.check())
    assert len(list(tmp_path.glob("*.jsonl"))) == 1
    owners.acknowledged = {0: 3, 1: 3}
    asyncio.run(second.check())
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_spool_file_is_set_aside_and_a_partial_one_deleted(tmp_path: Path) -> None:
    spool = DirectorySpool(tmp_path)
    good = spool.write([two_calls("a1", 1.0)])
    (tmp_path / "0-1-0.jsonl").write_bytes(b'{"rollout_id": "x"}\n')
    (tmp_path / "0-1-1.jsonl.partial").write_bytes(b"{")
    assert [(name, [s.key for s in batch]) for name, batch in spool.load()] == [(good, ["a1"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-1-0.jsonl.unreadable", good]


def test_with_the_broker_away_everything_is_kept_and_the_failure_counted() -> None:
    owners = Owners(ends={0: 1, 1: 1}, acknowledged={0: 1, 1: 1}, down=True)
    retained = RetainedSamples(owners)
    retained.hold([two_calls("a1", 1.0)])
    asyncio.run(retained.check())
    assert len(retained) == 1 and retained.stats.checks_failed == 1


def test_checks_are_throttled_and_skipped_when_nothing_is_held() -> None:
    now = [0.0]
    owners = Owners()
    retained = RetainedSamples(owners, RetentionConfig(check_every_s=1.0), clock=lambda: now[0])
    asyncio.run(retained.maybe_check())
    assert owners.reads == 0  # nothing held
    retained.hold([two_calls("a1", 1.0)])
    asyncio.run(retained.maybe_check())
    asyncio.run(retained.maybe_check())
    assert owners.reads == 1
    now[0] = 1.5
    asyncio.run(retained.maybe_check())
    assert owners.reads == 2


@pytest.mark.parametrize(("field_name", "value"), [("budget_bytes", -1), ("check_every_s", 0.0)])
def test_bad_settings_name_the_field(field_name: str, value: float) -> None:
    with pytest.raises(ValueError, match=field_name):
        RetentionConfig(**{field_name: value})  # type: ignore[arg-type]
