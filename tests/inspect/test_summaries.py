"""What the group and pipeline pages compute from the table's rows and the log's events."""

from __future__ import annotations

import math

import pytest

from pipeline.inspect.table import RolloutRow, member_advantages
from pipeline.inspect.timeline import bucket_width, duration, timeline
from topics.records import FinalizedEvent


def row(rollout_id: str, status: str, reward: float | None, samples: int = 1) -> RolloutRow:
    return RolloutRow(
        rollout_id=rollout_id,
        run_id=None,
        group_id="g",
        status=status,
        failure_code=None if status == "accepted" else "digest_mismatch",
        reward=reward,
        calls=1,
        tokens=10,
        min_version=0,
        max_version=0,
        sample_policy="chains" if samples > 1 else "terminal",
        sample_keys=tuple(f"{rollout_id}@c{i}" for i in range(samples)) if status == "accepted" else (),
    )


def test_group_advantages_count_every_sample_and_skip_the_rejected() -> None:
    """As the trainer's batch: ``a``'s two chains weigh twice in the mean and spread."""
    members = [row("a", "accepted", 1.0, samples=2), row("b", "accepted", 0.0), row("c", "rejected", 0.5)]
    mean, std = 2 / 3, math.sqrt(2 / 9)
    advantages = member_advantages(members)
    assert advantages == pytest.approx({"a": (1 - mean) / (std + 1e-6), "b": (0 - mean) / (std + 1e-6)})


def test_a_lone_or_rewardless_member_has_advantage_zero() -> None:
    assert member_advantages([row("a", "accepted", 1.0), row("b", "rejected", None)]) == {"a": 0.0}
    assert member_advantages([row("a", "accepted", None), row("b", "accepted", 1.0)]) == {"a": 0.0, "b": 0.0}


def finalized(i: int, at: float, code: str | None = None) -> FinalizedEvent:
    return FinalizedEvent(
        rollout_id=f"r{i}",
        status="rejected" if code else "accepted",
        rejection_reason=code,
        sample_key=None if code else f"r{i}",
        prompt_len=1,
        total_len=2,
        generated_tokens=1,
        call_count=1,
        finalized_at=at,
    )


def test_finalized_events_are_counted_per_bucket_with_rejections_by_code() -> None:
    """150 s of run: 5 s buckets; a stall in the middle stays visible as empty buckets."""
    events = [finalized(i, 1000.0 + i) for i in range(10)]
    events += [finalized(10, 1001.5, "digest_mismatch"), finalized(11, 1002.0, "digest_mismatch")]
    events += [finalized(12, 1149.0, "ambiguous_terminal")]
    line = timeline(events)
    assert line.width_s == 5 and line.width == "5 s"
    assert len(line.buckets) == 30 and line.buckets[0].start == 1000.0
    assert [b.accepted for b in line.buckets[:3]] == [5, 5, 0]
    assert line.buckets[0].rejected == {"digest_mismatch": 2}
    assert line.buckets[-1].rejected == {"ambiguous_terminal": 1} and line.buckets[-1].offset_s == 145.0
    assert sum(b.finalized for b in line.buckets) == 13 and line.peak == 7
    assert [b.finalized for b in line.buckets[2:-1]] == [0] * 27
    assert line.codes == ["digest_mismatch", "ambiguous_terminal"]
    assert [code for code, _, _ in line.stack(line.buckets[0])] == line.codes


def test_bucket_widths_stay_round_and_few() -> None:
    assert [bucket_width(s) for s in (0, 59, 60, 3599, 3600, 86400)] == [1, 1, 5, 60, 300, 1800]
    assert timeline([]).buckets == []
    assert [duration(s) for s in (0, 59, 90, 3600, 3 * 3600 + 1200)] == [
        "0 s",
        "59 s",
        "1 min 30 s",
        "1 h",
        "3 h 20 min",
    ]
