"""Each train step's mismatch report and the trainer's per-token logprobs, kept on disk.

The run's summary carries every step's report; the per-token logprobs the trainer
recomputed are too many for it, and the inspector (DESIGN §16) shows them beside the
behaviour's in a sample's token view. One JSON file per step under ``DATA_DIR/steps/``,
written whole (a temporary file renamed into place), so a reader never sees half a step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

STEPS_DIR = "steps"


@dataclass(frozen=True, slots=True)
class StepLog:
    """One step as written: who trained, on which version, its reward, its report, its logprobs."""

    run_id: str
    step: int
    trainer: str
    weight_version: int
    reward_mean: float | None
    """The mean reward of the samples the step trained on (None: none had one; or a step
    file written before steps recorded it)."""
    mismatch: Mapping[str, Any]
    trainer_logprobs: Mapping[str, Sequence[float]]
    """Per sample key, the trainer's logprob at every position (0 where the mask is 0)."""
    trainer_metrics: Mapping[str, float | None]
    """What the trainer itself logged of the step (TRL: its loss, importance-sampling ratio
    against the captured logprobs, clip fractions; the built-in step: its loss, update norm
    policy shift and clip fraction), beside tokentrail's own ``mismatch``; empty until it logged. None: a
    value that was not a finite number (JSON has no NaN)."""

    @property
    def name(self) -> str:
        return step_name(self.run_id, self.step)


def step_name(run_id: str, step: int) -> str:
    """A step's name: its file's stem, and the inspector's key for it."""
    return f"{run_id}-step-{step}"


class StepWriter:
    """Writes a run's steps into ``data_dir/steps``."""

    def __init__(self, data_dir: Path, run_id: str, trainer: str) -> None:
        self.directory = data_dir / STEPS_DIR
        self.run_id = run_id
        self.trainer = trainer

    def write(
        self,
        step: int,
        weight_version: int,
        mismatch: Mapping[str, Any],
        trainer_logprobs: Mapping[str, Sequence[float]],
        *,
        reward_mean: float | None,
        trainer_metrics: Mapping[str, float] | None = None,
    ) -> Path:
        """``trainer_metrics``: None when the trainer logs them after the step's report
        (TRL, after its optimizer step): ``add_trainer_metrics`` adds them then."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(step)
        _replace(
            path,
            {
                "run_id": self.run_id,
                "step": step,
                "trainer": self.trainer,
                "weight_version": weight_version,
                "reward_mean": reward_mean,
                "mismatch": mismatch,
                "trainer_logprobs": trainer_logprobs,
                "trainer_metrics": dict(trainer_metrics or {}),
            },
        )
        return path

    def add_trainer_metrics(self, step: int, metrics: Mapping[str, float]) -> Path:
        """Put what the trainer logged of ``step`` into its written file."""
        path = self._path(step)
        document = orjson.loads(path.read_bytes())
        document["trainer_metrics"] = dict(metrics)
        _replace(path, document)
        return path

    def _path(self, step: int) -> Path:
        return self.directory / f"{step_name(self.run_id, step)}.json"


def _replace(path: Path, document: Mapping[str, Any]) -> None:
    """Write whole or not at all: a reader sees the old file or the new one."""
    partial = path.with_suffix(".json.partial")
    partial.write_bytes(orjson.dumps(document))
    os.replace(partial, path)


def read_steps(data_dir: Path) -> tuple[list[StepLog], int]:
    """Every step written under ``data_dir``, by run and step, and how many files were unreadable."""
    steps: list[StepLog] = []
    unreadable = 0
    for path in sorted((data_dir / STEPS_DIR).glob("*.json")):
        try:
            document = orjson.loads(path.read_bytes())
            steps.append(
                StepLog(
                    run_id=str(document["run_id"]),
                    step=int(document["step"]),
                    trainer=str(document["trainer"]),
                    weight_version=int(document["weight_version"]),
                    reward_mean=_optional_float(document.get("reward_mean")),
                    trainer_metrics={
                        str(name): _optional_float(value)
                        for name, value in (document.get("trainer_metrics") or {}).items()
                    },
                    mismatch=dict(document["mismatch"]),
                    trainer_logprobs=dict(document["trainer_logprobs"]),
                )
            )
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            unreadable += 1
    steps.sort(key=lambda log: (log.run_id, log.step))
    return steps, unreadable


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


__all__ = ["STEPS_DIR", "StepLog", "StepWriter", "read_steps", "step_name"]
