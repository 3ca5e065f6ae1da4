"""Training batches: padding, positions, GRPO advantages, staleness, group assembly."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from stages.finalize.reader import FinalizedRollout, Group, GroupCollector
from stages.trainer.advantages import group_advantages
from stages.trainer.batch import build_batch
from stages.trainer.staleness import StalenessPolicy
from topics import digest
from topics.records import FinalizedEvent, TrainingSample


def sample(key: str, n: int, reward: float | None, versions: tuple[int, int] = (0, 0)) -> TrainingSample:
    ids = list(range(10, 10 + n))
    rollout_id = key.split("@")[0]
    return TrainingSample.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": "g",
            "token_ids": ids,
            "token_mask": [0.0, 0.0] + [1.0] * (n - 2),
            "logprobs": [0.0, 0.0] + [-0.5] * (n - 2),
            "weight_versions": [versions[0]] * (n - 1) + [versions[1]],
            "spans": [{"call_id": "c1", "start": 0, "carry_len": 2, "gen_len": n - 2}],
            "reward": reward,
            "cumulative_hash": digest.cumulative_hash(ids),
            "sample_key": key if "@" in key else None,
        }
    )


def event(rollout_id: str, status: str = "accepted", group_id: str | None = "g") -> FinalizedEvent:
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "group_id": group_id,
        "status": status,
        "prompt_len": 0,
        "total_len": 0,
        "generated_tokens": 0,
        "call_count": 1,
        "finalized_at": 1.0,
    }
    if status == "accepted":
        fields["sample_key"] = rollout_id
    else:
        fields["rejection_reason"] = "digest_mismatch"
    return FinalizedEvent.model_validate(fields)


def member(rollout_id: str, *samples: TrainingSample) -> FinalizedRollout:
    return FinalizedRollout(event(rollout_id, "accepted" if samples else "rejected"), samples)


def test_tensors_are_padded_and_aligned_with_the_samples() -> None:
    group = Group("g", [member("a", sample("a", 5, 1.0)), member("b", sample("b", 3, 0.0)), member("c")])
    batch = build_batch([group], policy_version=0, staleness=StalenessPolicy())
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [10, 11, 12, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.old_logprobs[0].tolist() == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)  # (r - 0.5) / 0.5
    assert [m.event.rollout_id for m in batch.groups[0].rejected] == ["c"]  # the hole is visible


def test_a_calls_own_reward_is_on_the_last_token_of_its_span() -> None:
    plain = sample("a", 5, 1.0)
    rewarded = plain.model_copy(update={"spans": [plain.spans[0].model_copy(update={"reward": 0.4})]})
    group = Group("g", [member("a", rewarded), member("b", sample("b", 3, 0.0))])
    batch = build_batch([group], policy_version=0, staleness=StalenessPolicy())
    assert batch.call_rewards[0].tolist() == pytest.approx([0, 0, 0, 0, 0.4])
    assert batch.call_rewards[1].tolist() == [0.0] * 5


def test_every_chain_of_a_multi_sample_rollout_counts_in_its_group() -> None:
    chains = (sample("a@c1", 4, 1.0), sample("a@c2", 4, 1.0))
    group = Group("g", [FinalizedRollout(event("a"), chains), member("b", sample("b", 4, 0.0))])
    batch = build_batch([group], policy_version=0, staleness=StalenessPolicy())
    mean, std = 2 / 3, math.sqrt(2 / 9)
    expected = [(1 - mean) / std, (1 - mean) / std, (0 - mean) / std]
    assert batch.advantages.tolist() == pytest.approx(expected, abs=1e-4)


def test_groups_are_normalized_apart_and_a_group_of_one_has_no_advantage() -> None:
    first = Group("g1", [member("a", sample("a", 4, 3.0)), member("b", sample("b", 4, 1.0))])
    alone = Group("g2", [member("c", sample("c", 4, 5.0))])
    batch = build_batch([first, alone], policy_version=0, staleness=StalenessPolicy())
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)


def test_the_batch_carries_group_advantages_of_each_group() -> None:
    """The function the inspector shows advantages with is the batch's own."""
    rewards = [1.0, None, 0.0, 0.5]
    group = Group("g", [member(k, sample(k, 4, r)) for k, r in zip("abcd", rewards, strict=True)])
    batch = build_batch([group], policy_version=0, staleness=StalenessPolicy())
    assert batch.advantages.tolist() == pytest.approx(group_advantages(rewards), abs=1e-6)
    assert group_advantages(rewards)[1] == 0.0 and group_advantages([2.0, None]) == [0.0, 0.0]


def test_a_sample_without_reward_trains_with_weight_zero() -> None:
    group = Group("g", [member("a", sample("a", 4, None)), member("b", sample("b", 4, 1.0))])
    batch = build_batch([group], policy_version=0, staleness=StalenessPolicy())
    assert math.isnan(batch.rewards[0]) and batch.sample_weights.tolist() == [0.0, 1.0]
    assert batch.advantages.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("mode", "weights", "stale"), [("drop", [1.0], ["old"]), ("downweight", [1.0, 1 / 3], [])]
)
def test_staleness_drops_or_downweights_old_samples(
    mode: Any, weights: list[float], stale: list[str]
) -> None:
    fresh, old = sample("new", 4, 1.0, (5, 5)), sample("old", 4, 0.0, (2, 5))
    group = Group("g", [member("new", fresh), member("old", old)])
    batch = build_batch([group], policy_version=5, staleness=StalenessPolicy(max_staleness=1, mode=mode))
    assert batch.sample_weights.tolist() == pytest.approx(weights)
    assert batch.stale == stale
    assert batch.weight_versions.tolist()[0] == [5, 5]


def test_an_empty_batch_has_empty_tensors() -> None:
    batch = build_batch([Group("g", [member("a")])], policy_version=0, staleness=StalenessPolicy())
    assert batch.input_ids.shape == (0, 0) and batch.weight_versions.shape == (0, 2) and len(batch) == 0
    assert batch.advantages.dtype == torch.float32


def test_groups_complete_or_are_released_partial_after_the_timeout() -> None:
    now = [0.0]
    collector = GroupCollector(3, timeout_s=10, clock=lambda: now[0])
    assert collector.add(FinalizedRollout(event("a", group_id="g1"))) is None
    now[0] = 5.0
    assert collector.add(FinalizedRollout(event("b", group_id="g2"))) is None
    assert collector.add(FinalizedRollout(event("c", group_id="g2"))) is None
    assert collector.expired() == []
    now[0] = 10.5
    (partial,) = collector.expired()
    assert (partial.group_id, partial.partial, len(partial.members)) == ("g1", True, 1)
    late = collector.add(FinalizedRollout(event("d", group_id="g1")))
    assert late is not None and late.late and [m.event.rollout_id for m in late.members] == ["d"]
    complete = collector.add(FinalizedRollout(event("e", group_id="g2")))
    assert complete is not None and not complete.partial and len(complete.members) == 3


@pytest.mark.parametrize(("measure", "age"), [("oldest", 3), ("newest", 0), ("admission", 2)])
def test_staleness_is_measured_by_the_oldest_newest_or_admission_version(measure: Any, age: int) -> None:
    straddler = sample("s", 5, 1.0, (3, 5))  # versions [3, 3, 3, 3, 5]: its first call came in at 3
    straddler = straddler.model_copy(update={"weight_versions": [3, 2, 3, 4, 5]})  # oldest 2, newest 5
    policy = StalenessPolicy(max_staleness=2, measure=measure)
    batch = build_batch([Group("g", [member("s", straddler)])], policy_version=5, staleness=policy)
    assert policy.staleness(straddler, 5) == age
    assert batch.stale == ([] if age <= 2 else ["s"])
    assert batch.staleness.tolist() == ([] if age > 2 else [age])
    if age <= 2:
        assert batch.samples[0].weight_versions == [3, 2, 3, 4, 5]  # every token's version stays


@pytest.mark.parametrize(
    ("fields", "named"), [({"measure": "middle"}, "measure"), ({"mode": "skip"}, "mode")]
)
def test_a_bad_staleness_policy_is_refused_naming_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StalenessPolicy(max_staleness=1, **fields)
