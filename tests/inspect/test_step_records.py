"""A train step's file as the inspector reads it: its reward, its mismatch report and what
the trainer itself logged, written whole; and the step page showing the trainer's log."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fastapi.testclient import TestClient

from pipeline.auth.credentials import Credentials
from pipeline.inspect.app import create_inspect_app
from pipeline.inspect.log import LogUnavailable
from pipeline.inspect.source import RunSource
from pipeline.samples.archive import ARCHIVE_NAME
from pipeline.trainer.recompute import replay_counts
from pipeline.trainer.steplog import STEPS_DIR, StepWriter, read_steps
from stages.trainer.mismatch import concat, report

EMPTY = concat([])
REPORT = report(EMPTY, [], policy_version=0) | replay_counts([], EMPTY)
"""A real report (of a step with no generated token: every metric None)."""


def test_reward_and_the_trainers_metrics_round_trip(tmp_path: Path) -> None:
    writer = StepWriter(tmp_path, "run-a", "trl")
    writer.write(1, 0, REPORT, {"s1": [0.0, -0.5]}, reward_mean=0.375)
    (log,), unreadable = read_steps(tmp_path)
    assert unreadable == 0 and log.reward_mean == 0.375 and log.trainer_metrics == {}
    writer.add_trainer_metrics(1, {"loss": -0.5, "clip_ratio/region_mean": 0.125})
    (log,), _ = read_steps(tmp_path)
    assert log.trainer_metrics == {"loss": -0.5, "clip_ratio/region_mean": 0.125}
    assert log.trainer_logprobs == {"s1": [0.0, -0.5]} and log.mismatch == REPORT
    assert not list((tmp_path / STEPS_DIR).glob("*.partial"))


def test_a_step_file_from_before_rewards_were_recorded_still_reads(tmp_path: Path) -> None:
    (tmp_path / STEPS_DIR).mkdir()
    older = {"run_id": "run-a", "step": 1, "trainer": "builtin", "weight_version": 0}
    (tmp_path / STEPS_DIR / "run-a-step-1.json").write_text(
        json.dumps({**older, "mismatch": REPORT, "trainer_logprobs": {}})
    )
    (tmp_path / STEPS_DIR / "run-a-step-2.json").write_text(json.dumps({**older, "reward_mean": "high"}))
    (log,), unreadable = read_steps(tmp_path)
    assert log.reward_mean is None and log.trainer_metrics == {} and unreadable == 1


def test_the_step_page_shows_what_the_trainer_logged(tmp_path: Path) -> None:
    (tmp_path / ARCHIVE_NAME).write_text("")
    writer = StepWriter(tmp_path, "run-a", "trl")
    writer.write(1, 0, REPORT, {}, reward_mean=0.5)
    client = TestClient(
        create_inspect_app(RunSource(tmp_path, LogUnavailable("none"), None), Credentials({}))
    )
    assert "The trainer's own log" not in client.get("/steps/run-a-step-1").text
    writer.add_trainer_metrics(
        1, {"loss": 0.0123, "sampling/importance_sampling_ratio/max": 2.0, "policy_shift": math.nan}
    )
    client = TestClient(
        create_inspect_app(RunSource(tmp_path, LogUnavailable("none"), None), Credentials({}))
    )
    page = client.get("/steps/run-a-step-1").text
    assert '<dd data-trainer-metric="loss">0.0123</dd>' in page
    assert '<dd data-trainer-metric="sampling/importance_sampling_ratio/max">2</dd>' in page
    assert '<dd data-trainer-metric="policy_shift">-</dd>' in page  # NaN is written as null
