"""Small valid rows and samples for tests that need something in the data plane."""

from __future__ import annotations

from topics import digest
from topics.records import StagedCall, TrainingSample
from topics.staging import staging_row


def text_row(rollout_id: str, call_id: str) -> StagedCall:
    """A digested root row of three tokens (two prompt, one generated)."""
    return staging_row(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=digest.build_delta([1, 2], [3], [-0.5], 0),
        weight_version=0,
    )


PROMPT, FIRST, TOOL, SECOND = [5, 6, 7], [20, 21], [8, 9], [22, 23]


def two_calls(rollout_id: str, reward: float | None) -> TrainingSample:
    """A prompt, a reply, a tool result carried into the second call, and its reply."""
    ids = PROMPT + FIRST + TOOL + SECOND
    return TrainingSample.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": "g",
            "token_ids": ids,
            "token_mask": [0.0] * 3 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2,
            "logprobs": [0.0] * 3 + [-0.1, -0.2] + [0.0] * 2 + [-0.3, -0.4],
            "weight_versions": [0] * 7 + [1] * 2,
            "spans": [
                {"call_id": "c1", "start": 0, "carry_len": 3, "gen_len": 2},
                {"call_id": "c2", "start": 5, "carry_len": 2, "gen_len": 2},
            ],
            "reward": reward,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )
