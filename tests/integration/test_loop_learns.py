"""The closed loop learns: on the dense digits reward, the mean reward of the last training
steps exceeds that of the first, with each trainer, under a fixed seed.

Every other closed-loop test checks ratios, versions and drained samples, which a loop that
trains nothing would pass too. This one asserts behaviour: ``tokentrail run --reward digits
--train-steps N`` (``bench.learning``, whose figures bench/RESULTS.md records) raises the
share of digits the tiny model writes. The margin is a stated fraction of the reward's
range, well under what the recorded curves rise, so it fails on a loop that does not learn
and not on a loop that learns a little differently.
"""

from __future__ import annotations

import pytest

from bench.learning import LearningConfig, curve

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

MARGIN = 0.15
"""Of a reward in [0, 1]: the last steps' mean reward must exceed the first steps' by this."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", ["builtin", "trl"])
def test_the_reward_rises_with_each_trainer(trainer: str) -> None:
    learned = curve(trainer, LearningConfig(trainers=(trainer,)))
    assert learned["rise"] > MARGIN, learned
    assert all(deviation < 1e-3 for deviation in learned["ratio_max_abs_dev"]), learned
