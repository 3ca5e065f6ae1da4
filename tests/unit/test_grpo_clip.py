"""The built-in GRPO step reports how much of the batch its PPO clip cut: none on policy;
with behaviour logprobs 1 nat below the trainer's (ratio e), exactly the tokens whose
advantage is positive (there the clipped term is the smaller one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.models.tiny import make_tiny_model
from pipeline.trainer.grpo import GrpoTrainer
from stages.finalize.reader import FinalizedRollout, Group
from stages.trainer.batch import TrainBatch, build_batch
from stages.trainer.staleness import StalenessPolicy
from topics import digest
from topics.records import FinalizedEvent, TrainingSample


def sample(rollout_id: str, generated: int, reward: float) -> TrainingSample:
    ids = list(range(10, 13 + generated))
    return TrainingSample.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": "g",
            "token_ids": ids,
            "token_mask": [0.0] * 3 + [1.0] * generated,
            "logprobs": [0.0] * len(ids),
            "weight_versions": [0] * len(ids),
            "spans": [{"call_id": "c1", "start": 0, "carry_len": 3, "gen_len": generated}],
            "reward": reward,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def batch_of(*samples: TrainingSample) -> TrainBatch:
    members = [
        FinalizedRollout(
            FinalizedEvent.model_validate(
                {
                    "rollout_id": s.rollout_id,
                    "group_id": "g",
                    "status": "accepted",
                    "sample_key": s.key,
                    "prompt_len": 3,
                    "total_len": len(s.token_ids),
                    "generated_tokens": len(s.token_ids) - 3,
                    "call_count": 1,
                    "finalized_at": 1.0,
                }
            ),
            (s,),
        )
        for s in samples
    ]
    return build_batch([Group("g", members)], policy_version=0, staleness=StalenessPolicy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.mark.parametrize(("offset", "clipped"), [(0.0, 0.0), (1.0, 4 / 6)])
def test_the_clip_fraction_counts_the_tokens_whose_gradient_the_clip_cut(
    model_dir: Path, offset: float, clipped: float
) -> None:
    batch = batch_of(sample("a", 4, 1.0), sample("b", 2, 0.0))
    trainer = GrpoTrainer(model_dir, learning_rate=1e-3)
    batch.old_logprobs = (trainer.token_logprobs(batch).detach() - offset) * batch.loss_mask
    report = trainer.step(batch)
    assert report.clip_fraction == pytest.approx(clipped)
    assert report.tokens == 6
