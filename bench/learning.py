"""Does the closed loop learn: mean reward per training step, each trainer, side by side.

A loop that computes exact ratios and trains nothing would pass every other check, so
this runs ``tokentrail run --reward digits --train-steps N`` (the dense reward a tiny
random model can raise: the share of digits in its replies, DESIGN §14) with the
built-in GRPO step and with TRL's ``GRPOTrainer``, on one seed each, and reports every
step's mean reward, the rise from the first steps to the last, and each step's largest
training-inference ratio deviation (the trainer scoring the distribution that sampled).

Run: ``tokentrail bench learning [--quick] [--json] [--plot FILE.png]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import plots
from bench.command import Benchmark, Option, Quick, names
from bench.common import machine, versions


@dataclass(frozen=True, slots=True)
class LearningConfig:
    trainers: tuple[str, ...] = ("builtin", "trl")
    steps: int = 12
    rollouts: int = 8
    """Rollouts per step, in groups of ``group_size``."""
    group_size: int = 4
    max_tokens: int = 16
    learning_rate: float = 0.03
    seed: int = 0
    window: int = 3
    """Steps averaged at each end for the rise."""


QUICK = Quick(
    "4 steps of 4 rollouts, the built-in trainer", LearningConfig(trainers=("builtin",), steps=4, rollouts=4)
)
OPTIONS = (
    Option("--trainers", "trainers, comma separated (default builtin,trl)", names),
    Option("--steps", "training steps per trainer (default 12)", int),
    Option("--learning-rate", "the trainers' learning rate (default 0.03)", float),
    Option("--seed", "the run's seed (default 0)", int),
    Option("--plot", "write the reward curves to this PNG", str, for_run=True),
)


def curve(trainer: str, config: LearningConfig) -> dict[str, Any]:
    """One ``tokentrail run`` with ``trainer``: its steps' mean reward and ratio deviation."""
    with tempfile.TemporaryDirectory(prefix="tokentrail-learning-") as scratch:
        command = [
            *("run", "--json", "--reward", "digits", "--trainer", trainer),
            *("--train-steps", str(config.steps), "--rollouts", str(config.rollouts)),
            *("--group-size", str(config.group_size), "--max-tokens", str(config.max_tokens)),
            *("--learning-rate", str(config.learning_rate), "--seed", str(config.seed)),
            *("--data-dir", str(Path(scratch) / "tt")),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"tokentrail {' '.join(command)} exited {done.returncode}")
    summary = json.loads(done.stdout)
    steps = summary["train_steps"]
    rewards = [step["reward_mean"] for step in steps]
    first, last = rewards[: config.window], rewards[-config.window :]
    return {
        "trainer": trainer,
        "rewards": rewards,
        "ratio_max_abs_dev": [step["ratio_max_abs_dev"] for step in steps],
        "first_mean": sum(first) / len(first),
        "last_mean": sum(last) / len(last),
        "rise": sum(last) / len(last) - sum(first) / len(first),
    }


def run(config: LearningConfig, plot: str | None = None) -> dict[str, Any]:
    curves = [curve(trainer, config) for trainer in config.trainers]
    report = {
        "config": asdict(config),
        "machine": machine(),
        "versions": versions(("torch", "trl")),
        "curves": curves,
    }
    if plot:
        report["plot"] = str(plots.learning_curves(curves, plot))
    return report


def render(report: dict[str, Any]) -> str:
    lines = ["trainer   first steps  last steps   rise   rewards per step"]
    for row in report["curves"]:
        rewards = " ".join(f"{value:.2f}" for value in row["rewards"])
        lines.append(
            f"{row['trainer']:<9} {row['first_mean']:>11.3f} {row['last_mean']:>11.3f} {row['rise']:>6.3f}   {rewards}"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("learning", __doc__, LearningConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
