"""The benchmark's wrong temperature: a fed sample's calls restated, the trainer's replay
following them, and every setting that asks for it refusing what it cannot mean."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from rowkit import two_calls

from pipeline.run.config import RunConfig
from pipeline.trainer.feed import FeedSettings
from pipeline.trainer.shift import shift_behaviour_temperature
from stages.trainer.batch import audit_batch
from topics.sampling import SamplingProvenance


def test_every_recorded_call_claims_the_shifted_temperature_and_its_logprobs_stay() -> None:
    sample = two_calls("r1", 1.0)
    truncated = SamplingProvenance(temperature=1.0, top_k=20)
    sample = sample.model_copy(
        update={"spans": [sample.spans[0].model_copy(update={"sampling": truncated}), sample.spans[1]]}
    )
    shifted = shift_behaviour_temperature(sample, 0.7)
    first, second = shifted.spans
    assert first.sampling is not None and first.sampling.temperature == 0.7 and first.sampling.top_k == 20
    assert second.sampling is None  # a call without provenance stays unknown
    assert shifted.logprobs == sample.logprobs and shifted.token_ids == sample.token_ids
    assert sample.spans[0].sampling == truncated  # the original is untouched
    batch = audit_batch([shifted])
    generated = batch.loss_mask[0] > 0
    assert batch.temperature[0][generated].tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0])


def test_a_temperature_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^temperature:"):
        shift_behaviour_temperature(two_calls("r1", 1.0), 0.0)
    with pytest.raises(ValueError, match=r"^shift_behaviour_temperature:"):
        FeedSettings(group_size=2, shift_behaviour_temperature=-1.0)


@pytest.mark.parametrize(
    "bad",
    [{"shift_behaviour_temperature": 0.7}, {"train_steps": 2, "shift_behaviour_temperature": 0.0}],
)
def test_the_run_refuses_a_shift_without_training_or_a_nonpositive_one(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"(?m)^(  Value error, )?shift_behaviour_temperature:"):
        RunConfig(**bad)
    assert RunConfig(train_steps=2).shift_behaviour_temperature is None  # off by default
