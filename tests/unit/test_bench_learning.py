"""``bench learning``'s report as a person reads it: each run by its label (shifted or not),
its mismatch per step and its trainer's own correction per step; and the option that asks
for the shifted runs reaching the config."""

from __future__ import annotations

import argparse
from typing import Any

from bench.learning import BENCHMARK, LearningConfig, render


def curve(label: str, corrections: list[dict[str, float | None]]) -> dict[str, Any]:
    return {
        "label": label,
        "rewards": [0.25, 0.75],
        "first_mean": 0.25,
        "last_mean": 0.75,
        "rise": 0.5,
        "k3": [1.5e-12, None],
        "ratio_max": [1.0, 1.75],
        "tis_clipped_fraction": [0.0, 0.0],
        "mis_masked_fraction": [0.0, 0.125],
        "trainer_correction": corrections,
    }


def test_the_report_shows_both_runs_their_mismatch_and_their_own_correction() -> None:
    report = {
        "curves": [
            curve("builtin", [{"clip_fraction": 0.0}, {"clip_fraction": 0.0}]),
            curve("builtin, behaviour at T=0.7", [{"clip_fraction": 0.5}, {"clip_fraction": None}]),
        ]
    }
    text = render(report)
    assert "builtin, behaviour at T=0.7        0.250       0.750  0.500   0.25 0.75" in text
    assert "1.5e-12/1/0/0  -/1.8/0/0.12" in text
    assert "builtin, behaviour at T=0.7  clip_fraction: 0.5 -" in text


def test_the_shift_option_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    BENCHMARK.add_arguments(parser)
    args = parser.parse_args(["--shift-behaviour-temperature", "0.7", "--trainers", "builtin"])
    assert BENCHMARK.config(args) == LearningConfig(trainers=("builtin",), shift_behaviour_temperature=0.7)
    assert LearningConfig().shift_behaviour_temperature is None  # not run unless asked
