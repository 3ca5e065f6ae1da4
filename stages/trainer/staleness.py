"""How stale a sample is, and what becomes of one too stale: a pure policy (no torch), so
that configuration can name its choices without loading the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from topics.records import TrainingSample

StaleMode = Literal["drop", "downweight"]
StaleMeasure = Literal["oldest", "newest", "admission"]


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """How far behind the trainer's weights a sample may be (AReaL-style bounded staleness).

    A sample's staleness is the trainer's current weight version minus the sample's
    version, by ``measure``: the oldest of its tokens' versions, the newest, or its
    admission's (the version its first call was admitted under: the first token's, since
    a call's prompt carries the version the worker served when the call came in). Beyond
    ``max_staleness`` it is dropped, or trained with weight ``1 / (1 + excess)`` under
    ``downweight``; None admits every sample. Pacing (``stages.trainer.pacing``) keeps
    samples from getting that old; this is the safety net behind it.
    """

    max_staleness: int | None = None
    mode: StaleMode = "drop"
    measure: StaleMeasure = "oldest"

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.mode not in get_args(StaleMode):
            raise ValueError(f"mode: must be one of {get_args(StaleMode)}, got {self.mode!r}")
        if self.measure not in get_args(StaleMeasure):
            raise ValueError(f"measure: must be one of {get_args(StaleMeasure)}, got {self.measure!r}")

    def staleness(self, sample: TrainingSample, policy_version: int) -> int:
        """How many versions the sample is behind ``policy_version``, by ``measure`` (0 without tokens)."""
        versions = sample.weight_versions
        if not versions:
            return 0
        if self.measure == "oldest":
            version = min(versions)
        elif self.measure == "newest":
            version = max(versions)
        else:
            version = versions[0]
        return policy_version - version

    def weight(self, staleness: int) -> float | None:
        """The sample's weight, or None to drop it."""
        if self.max_staleness is None or staleness <= self.max_staleness:
            return 1.0
        if self.mode == "drop":
            return None
        return 1.0 / (1 + staleness - self.max_staleness)
