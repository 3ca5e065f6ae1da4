"""Does the closed loop learn: mean reward per training step, each trainer, side by side.

A loop that computes exact ratios and trains nothing would pass every other check, so
this runs ``tokentrail run --reward digits --train-steps N`` (the dense reward a tiny
random model can raise: the share of digits in its replies, DESIGN §14) with the
built-in GRPO step and with TRL's ``GRPOTrainer``, on one seed each, and reports every
step's mean reward, the rise from the first steps to the last, and each step's largest
training-inference ratio deviation (the trainer scoring the distribution that sampled).

``--shift-behaviour-temperature T`` runs each trainer a second time with every call stated
to the trainer at temperature ``T`` (``pipeline.trainer.shift``): the captured logprobs are
then of a wrong temperature to it, and the report shows per step what the mismatch report
measures (k3, the largest ratio), what the importance corrections would clip or mask, what
each trainer's own correction did (its step files' ``trainer_metrics``: the built-in step's
clip fraction, TRL's importance-sampling ratio), and the reward curve beside the unshifted one.

Run: ``tokentrail bench learning [--quick] [--json] [--plot FILE.png]
[--shift-behaviour-temperature T]``.
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
from pipeline.trainer.steplog import read_steps


@dataclass(frozen=True, slots=True)
class LearningConfig:
    trainers: tuple[str, ...] = ("builtin", "trl")
    steps: int = 12
    rollouts: int = 8
    """Rollouts per step, in groups of ``group_size``."""
    group_size: int = 4
    max_tokens: int = 16
    learning_rate: float = 0.03
    temperature: float = 1.0
    """The calls' sampling temperature (each trainer scores the distribution that sampled)."""
    seed: int = 0
    window: int = 3
    """Steps averaged at each end for the rise."""
    shift_behaviour_temperature: float | None = None
    """Also run each trainer with the behaviour logprobs at a wrong temperature (this one)."""


QUICK = Quick(
    "4 steps of 4 rollouts, the built-in trainer", LearningConfig(trainers=("builtin",), steps=4, rollouts=4)
)
OPTIONS = (
    Option("--trainers", "trainers, comma separated (default builtin,trl)", names),
    Option("--steps", "training steps per trainer (default 12)", int),
    Option("--learning-rate", "the trainers' learning rate (default 0.03)", float),
    Option("--temperature", "the calls' sampling temperature (default 1.0)", float),
    Option("--seed", "the run's seed (default 0)", int),
    Option(
        "--shift-behaviour-temperature",
        "also run each trainer told its calls sampled at this temperature (default: not run)",
        float,
    ),
    Option("--plot", "write the reward curves to this PNG", str, for_run=True),
)
CORRECTION_METRICS = (
    "clip_fraction",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "clip_ratio/region_mean",
)
"""What each trainer logs of its own correction, from its step files (``trainer_metrics``):
the built-in step's PPO clip fraction; TRL's importance-sampling ratio against the captured
logprobs (after its cap), their log difference, and its clip fraction."""


def curve(trainer: str, config: LearningConfig, shift: float | None = None) -> dict[str, Any]:
    """One ``tokentrail run`` with ``trainer`` (its calls stated at temperature ``shift``
    when given): its steps' mean reward, mismatch and importance-correction statistics."""
    with tempfile.TemporaryDirectory(prefix="tokentrail-learning-") as scratch:
        command = [
            *("run", "--json", "--reward", "digits", "--trainer", trainer),
            *("--train-steps", str(config.steps), "--rollouts", str(config.rollouts)),
            *("--group-size", str(config.group_size), "--max-tokens", str(config.max_tokens)),
            *("--learning-rate", str(config.learning_rate), "--temperature", str(config.temperature)),
            *("--seed", str(config.seed)),
            *("--data-dir", str(Path(scratch) / "tt")),
            *(() if shift is None else ("--shift-behaviour-temperature", str(shift))),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            check=False,
        )
        logs, _ = read_steps(Path(scratch) / "tt")
    if done.returncode != 0:
        raise RuntimeError(f"tokentrail {' '.join(command)} exited {done.returncode}")
    summary = json.loads(done.stdout)
    steps = summary["train_steps"]
    rewards = [step["reward_mean"] for step in steps]
    first, last = rewards[: config.window], rewards[-config.window :]
    mismatch = [step["mismatch"] or {} for step in steps]
    corrections = [(report.get("corrections") or {}).get("token", {}) for report in mismatch]
    return {
        "trainer": trainer,
        "label": trainer if shift is None else f"{trainer}, behaviour at T={shift:g}",
        "shift_behaviour_temperature": shift,
        "rewards": rewards,
        "ratio_max_abs_dev": [step["ratio_max_abs_dev"] for step in steps],
        "k3": [report.get("k3") for report in mismatch],
        "ratio_max": [report.get("ratio_max") for report in mismatch],
        "tis_clipped_fraction": [c.get("tis_clipped_fraction") for c in corrections],
        "mis_masked_fraction": [c.get("mis_masked_fraction") for c in corrections],
        "trainer_correction": [
            {name: value for name, value in log.trainer_metrics.items() if name in CORRECTION_METRICS}
            for log in logs
        ],
        "first_mean": sum(first) / len(first),
        "last_mean": sum(last) / len(last),
        "rise": sum(last) / len(last) - sum(first) / len(first),
    }


def run(config: LearningConfig, plot: str | None = None) -> dict[str, Any]:
    shifts = (
        (None,) if config.shift_behaviour_temperature is None else (None, config.shift_behaviour_temperature)
    )
    curves = [curve(trainer, config, shift) for trainer in config.trainers for shift in shifts]
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
    width = max(len(row["label"]) for row in report["curves"])
    lines = [f"{'trainer':<{width}}  first steps  last steps   rise   rewards per step"]
    for row in report["curves"]:
        rewards = " ".join(f"{value:.2f}" for value in row["rewards"])
        lines.append(
            f"{row['label']:<{width}}  {row['first_mean']:>11.3f} {row['last_mean']:>11.3f} {row['rise']:>6.3f}   {rewards}"
        )
    lines.append("")
    lines.append("per step: k3 / ratio max / TIS clipped (w > 2) / MIS masked (w outside [0.5, 2])")
    for row in report["curves"]:
        cells = zip(
            row["k3"], row["ratio_max"], row["tis_clipped_fraction"], row["mis_masked_fraction"], strict=True
        )
        lines.append(
            f"{row['label']:<{width}}  " + "  ".join("/".join(_short(v) for v in cell) for cell in cells)
        )
    lines.append("")
    lines.append("per step, each trainer's own correction (its step files' trainer_metrics)")
    for row in report["curves"]:
        steps = row["trainer_correction"]
        for name in sorted({name for step in steps for name in step}):
            values = " ".join(_short(step.get(name)) for step in steps)
            lines.append(f"{row['label']:<{width}}  {name}: {values}")
    return "\n".join(lines)


def _short(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


BENCHMARK = Benchmark("learning", __doc__, LearningConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
