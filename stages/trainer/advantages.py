"""GRPO advantages, as the trainer's batches carry them (``stages.trainer.batch``).

Apart from the batch so that what only shows the numbers, the inspector's group view
(DESIGN §16), computes them with the same function without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: Sequence[float | None]) -> list[float]:
    """One group's samples, each reward against the mean and spread of the group's rewards:
    ``(r - mean) / (std + ADVANTAGE_EPS)``. A sample without a reward gets 0, and so does
    every sample of a group with fewer than two rewards."""
    values = [reward for reward in rewards if reward is not None]
    if len(values) < 2:
        return [0.0] * len(rewards)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [0.0 if reward is None else (reward - mean) / (std + ADVANTAGE_EPS) for reward in rewards]
