"""The trainers' choices a command line offers, importable without torch (the CLI builds
every verb's parser at start-up)."""

from __future__ import annotations

from typing import Literal, get_args

TrainerDtype = Literal["float32", "bfloat16"]
TRAINER_DTYPES: tuple[TrainerDtype, ...] = get_args(TrainerDtype)
"""The weights a trainer may hold; bfloat16 against the fp32 engine is a known mismatch."""

ReplayMode = Literal["full", "temperature", "none"]
REPLAY_MODES: tuple[ReplayMode, ...] = get_args(ReplayMode)
"""How much of each call's processing a trainer replays (``pipeline.trainer.recompute.replaying``)."""

__all__ = ["REPLAY_MODES", "TRAINER_DTYPES", "ReplayMode", "TrainerDtype"]
