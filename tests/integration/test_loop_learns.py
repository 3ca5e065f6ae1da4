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
"""Of a reward in [0, 1]: the last steps' mean reward must exceed the first steps' by this.
A loop that trains nothing rises by 0 give or take about 0.05 (the step-to-step spread of
the mean reward, about 0.06, over three steps at each end), so it fails this."""

TRAINING = {
    "builtin": LearningConfig(trainers=("builtin",), steps=16, learning_rate=0.05),
    "trl": LearningConfig(trainers=("trl",), steps=12, learning_rate=0.03, temperature=2.0),
}
"""Each trainer's run, as bench/RESULTS.md records it. Which tokens a run samples varies
from run to run on CPU (the engine's batches shape its arithmetic), so the built-in SGD
step gets the steps and rate at which every recorded run rose well past the margin.

TRL's Adam moves every weight by about the rate at each step, whatever the gradient's size.
At temperature 1 the tiny model samples nearly one reply per prompt, so within a few steps
the policy settles on whichever reply it leaned to, and once a group's replies are alike
its advantages are 0 and nothing moves it again: in 1 of 12 recorded runs at 0.03 a reply
without digits (reward 0), at lower rates a mixed one (0.6–0.8). Sampled at 2, the groups
differ enough to climb: every recorded run reached 1."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", sorted(TRAINING))
def test_the_reward_rises_with_each_trainer(trainer: str) -> None:
    learned = curve(trainer, TRAINING[trainer])
    assert learned["rise"] > MARGIN, learned
    assert all(deviation < 1e-3 for deviation in learned["ratio_max_abs_dev"]), learned
