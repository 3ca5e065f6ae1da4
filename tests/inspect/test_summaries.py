"""What the group and pipeline pages compute from the table's rows and the log's events."""

from __future__ import annotations

import math

import pytest

from pipeline.inspect.table import RolloutRow, member_advantages


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
