"""The TRL bridge's pure parts: TRL's rollout fields from groups of samples, rejected members
filled without gradient or bias to the group mean, and prompts taken once each."""

from __future__ import annotations

import pytest
from rowkit import FIRST, PROMPT, SECOND, TOOL, two_calls

from pipeline.trainer.trl import (
    CALL_REWARDS_FIELD,
    REWARD_FIELD,
    distinct_in_order,
    environment_reward,
    rollout_fields,
)
from pipeline.trainer.trl_fields import SAMPLE_KEY_FIELD, SAMPLING_FIELD


def test_each_member_is_one_completion_with_its_mask_logprobs_and_reward() -> None:
    rollouts = rollout_fields([[two_calls("r1", 1.0), two_calls("r2", 0.0)]])
    out = rollouts.fields
    assert rollouts.filled == 0 and rollouts.unreplayable_masked_tokens == 0
    assert out["prompt_ids"] == [PROMPT, PROMPT]
    assert out["completion_ids"] == [FIRST + TOOL + SECOND] * 2
    assert out["env_mask"] == [[1, 1, 0, 0, 1, 1]] * 2
    assert out["logprobs"][0] == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4]
    assert environment_reward([], [], **{REWARD_FIELD: out[REWARD_FIELD]}) == [1.0, 0.0]


def test_a_rejected_member_trains_nothing_and_leaves_the_group_mean() -> None:
    rollouts = rollout_fields([[two_calls("r1", 1.0), None, two_calls("r3", 0.5)]])
    out = rollouts.fields
    assert rollouts.filled == 1
    assert out["env_mask"][1] == [0] * 6  # no gradient from it
    assert out[REWARD_FIELD] == [1.0, 0.75, 0.5]  # its reward is the accepted members' mean


def test_a_group_with_no_accepted_member_is_skipped_with_placeholders_that_train_nothing() -> None:
    """TRL still needs group-size completions per prompt: one masked token each, one reward
    for all (advantage 0), neutral sampling; the group is counted as skipped."""
    rollouts = rollout_fields([[two_calls("r1", 1.0), two_calls("r2", 0.0)], [None, None]])
    out = rollouts.fields
    assert rollouts.skipped == [1] and rollouts.filled == 0
    assert len(out["completion_ids"]) == 4
    assert out["env_mask"][2:] == [[0], [0]]
    assert out[REWARD_FIELD] == [1.0, 0.0, 0.0, 0.0]
    assert [
        len(out[name][3]) for name in ("prompt_ids", "completion_ids", "logprobs", CALL_REWARDS_FIELD)
    ] == [1] * 4
    assert out[SAMPLING_FIELD][3] == {"temperature": [1.0], "top_k": [0], "top_p": [1.0], "min_p": [0.0]}
    assert out[SAMPLE_KEY_FIELD][2:] == ["skipped group 1", "skipped group 1"]
    assert rollout_fields([[None], [None]]).skipped == [0, 1]


def test_trl_repeats_each_prompt_num_generations_times() -> None:
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    assert distinct_in_order([a, a, b, b], 2) == [a, b]
    with pytest.raises(ValueError, match="in a row"):
        distinct_in_order([a, b, a, b], 2)
    with pytest.raises(ValueError, match="multiple"):
        distinct_in_order([a, a, b], 2)


def test_per_call_rewards_sit_on_the_last_token_of_each_call_in_the_completion() -> None:
    sample = two_calls("r1", 1.0)
    rewarded = sample.model_copy(
        update={"spans": [sample.spans[0].model_copy(update={"reward": 0.2}), sample.spans[1]]}
    )
    out = rollout_fields([[rewarded, two_calls("r2", 0.0)]]).fields
    assert out[CALL_REWARDS_FIELD] == [[0.0, 0.2, 0.0, 0.0, 0.0, 0.0], [0.0] * 6]
