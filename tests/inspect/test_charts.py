"""The step charts' geometry: values to coordinates, axis scaling, gaps, one step, none."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeline.auth.credentials import Credentials
from pipeline.inspect.app import create_inspect_app
from pipeline.inspect.charts import (
    Chart,
    Series,
    finite,
    line_chart,
    linear_domain,
    log_domain,
    nice_step,
    run_charts,
    step_charts,
    x_ticks,
)
from pipeline.inspect.source import RunSource
from pipeline.samples.archive import ARCHIVE_NAME
from pipeline.trainer.steplog import StepLog, StepWriter


def lag_report(
    k3: float | None, ratio_max: float | None, lags: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """A step's mismatch report with what the steps page reads (the charts' metrics set)."""
    table = dict.fromkeys(("k1", "chi2_token", "max_abs_dev", "ess_token"))
    return {
        "tokens": 10,
        **table,
        "k3": k3,
        "ratio_max": ratio_max,
        "buckets": {
            "lag": {lag: {"k3": a, "ratio_max": b} for lag, (a, b) in lags.items()},
            "straddled": {"tokens": 0},
        },
    }


def step(n: int, reward: float | None, report: dict[str, Any], run_id: str = "run-a") -> StepLog:
    return StepLog(run_id, n, "builtin", n - 1, reward, report, trainer_logprobs={}, trainer_metrics={})


def inverse_y(chart: Chart, y: float) -> float:
    """The value a reader reads off the chart's axis at pixel ``y``."""
    lowest, highest = chart.y_ticks[0], chart.y_ticks[-1]
    fraction = (lowest.at - y) / (lowest.at - highest.at)
    if chart.log:
        low, high = math.log10(lowest.value), math.log10(highest.value)
        return float(10 ** (low + fraction * (high - low)))
    return lowest.value + fraction * (highest.value - lowest.value)


def test_points_lie_where_their_values_read_off_the_axes() -> None:
    chart = line_chart("r", "reward", "reward", [Series("mean", {1: 0.1, 2: 0.35, 3: 0.8})])
    points = chart.lines[0].points
    assert [p.step for p in points] == [1, 2, 3]
    assert [p.x for p in points] == [chart.left, (chart.left + chart.right) / 2, chart.right]
    for point in points:
        assert inverse_y(chart, point.y) == pytest.approx(point.value, abs=1e-2)
    assert chart.y_ticks[0].at == chart.bottom and chart.y_ticks[-1].at == chart.top
    assert chart.y_ticks[0].value <= 0.1 and chart.y_ticks[-1].value >= 0.8
    assert points[0].y > points[1].y > points[2].y  # larger values higher up
    assert [t.label for t in chart.x_ticks] == ["1", "2", "3"]


def test_a_log_axis_spans_the_decades_and_puts_nonpositive_values_on_its_floor() -> None:
    chart = line_chart("k3", "k3", "k3", [Series("all", {1: 3e-12, 2: 0.0, 3: 2e-2})], log=True)
    assert chart.y_ticks[0].label == "1e-12" and chart.y_ticks[0].value == pytest.approx(1e-12)
    assert chart.y_ticks[0].at == chart.bottom and chart.y_ticks[-1].at == chart.top
    assert chart.y_ticks[-1].value >= 2e-2
    first, zero, last = chart.lines[0].points
    assert zero.floor and zero.y == chart.bottom and zero.value == 0.0
    assert not first.floor and chart.top < first.y < chart.bottom
    for point in (first, last):
        assert inverse_y(chart, point.y) == pytest.approx(point.value, rel=0.01)


def test_missing_and_non_finite_values_break_the_line() -> None:
    values: dict[int, float | None] = {1: 1.0, 2: None, 3: math.nan, 4: 2.0, 5: 3.0, 6: math.inf}
    chart = line_chart("x", "x", "x", [Series("s", values)])
    line = chart.lines[0]
    assert [p.step for p in line.points] == [1, 4, 5]
    assert [[p.step for p in segment] for segment in line.segments] == [[1], [4, 5]]
    assert [t.label for t in chart.x_ticks] == ["1", "2", "3", "4", "5", "6"]  # every step keeps its place


def test_one_step_sits_mid_chart_inside_a_band() -> None:
    chart = line_chart("r", "reward", "reward", [Series("mean", {7: 0.5})])
    (point,) = chart.lines[0].points
    assert point.x == (chart.left + chart.right) / 2
    assert chart.top < point.y < chart.bottom
    assert [t.label for t in chart.x_ticks] == ["7"]


def test_no_steps_or_no_values_make_an_empty_chart() -> None:
    assert line_chart("r", "reward", "reward", []).empty
    assert line_chart("r", "reward", "reward", [Series("mean", {})]).empty
    only_gaps = line_chart("k3", "k3", "k3", [Series("all", {1: None, 2: None})], log=True)
    assert only_gaps.empty and len(only_gaps.x_ticks) == 2 and only_gaps.y_ticks


def test_scaling_helpers() -> None:
    assert nice_step(1.0, 5) == pytest.approx(0.2)
    assert nice_step(0.7, 5) == pytest.approx(0.2)
    assert nice_step(130.0, 5) == pytest.approx(50.0)
    low, high, spacing = linear_domain([0.12, 0.87])
    assert (low, high) == pytest.approx((0.0, 1.0)) and spacing == pytest.approx(0.2)
    assert linear_domain([1.0, 1.0])[:2] == pytest.approx((0.9, 1.1))
    assert linear_domain([0.0, 0.0])[:2] == pytest.approx((-1.0, 1.0))
    assert log_domain([3e-12, 2e-2]) == (-12, -1)
    assert log_domain([1e-3, 1e-3]) == (-3, -2)
    assert log_domain([0.0, -1.0]) == (-1, 0)
    assert [finite(v) for v in (None, "x", math.nan, -math.inf, True, 2)] == [
        None,
        None,
        None,
        None,
        None,
        2.0,
    ]


def test_many_steps_show_every_kth_number_and_the_last() -> None:
    steps = list(range(1, 31))
    ticks = x_ticks(steps, {s: float(s) for s in steps})
    labels = [t.label for t in ticks]
    assert labels[0] == "1" and labels[-1] == "30" and 10 <= len(labels) <= 13


def test_step_charts_read_reward_k3_and_ratio_by_lag_from_the_records() -> None:
    steps = [
        step(1, 0.2, lag_report(1e-9, 1.001, {"0": (1e-9, 1.001)})),
        step(2, None, lag_report(4e-3, 2.5, {"0": (1e-3, 1.5), "1": (8e-3, 2.5)})),
        step(3, 0.6, lag_report(None, None, {})),
    ]
    reward, k3, ratio = step_charts(steps)
    assert [(p.step, p.value) for p in reward.lines[0].points] == [(1, 0.2), (3, 0.6)]
    assert [line.name for line in k3.lines] == ["all tokens", "lag 0", "lag 1"]
    assert k3.log and not ratio.log
    assert [(p.step, p.value) for p in k3.lines[0].points] == [(1, 1e-9), (2, 4e-3)]
    assert [(p.step, p.value) for p in ratio.lines[2].points] == [(2, 2.5)]
    assert len({line.colour for line in k3.lines}) == 3


def test_two_runs_get_their_own_charts() -> None:
    charts = run_charts(
        [step(1, 0.1, lag_report(1e-9, 1.0, {}), "run-a"), step(1, 0.9, lag_report(1e-9, 1.0, {}), "run-b")]
    )
    assert list(charts) == ["run-a", "run-b"]
    assert charts["run-b"][0].lines[0].points[0].value == 0.9


def serve(data_dir: Path) -> TestClient:
    source = RunSource(data_dir, log=_no_log(), decoder=None)
    return TestClient(create_inspect_app(source, Credentials({})))


def _no_log() -> Any:
    from pipeline.inspect.log import LogUnavailable

    return LogUnavailable("no event log in this test")


def test_the_steps_page_draws_a_point_per_recorded_step(tmp_path: Path) -> None:
    """Server-rendered: every point carries its step and the record's exact value."""
    (tmp_path / ARCHIVE_NAME).write_text("")
    writer = StepWriter(tmp_path, "run-a", "builtin")
    rewards = [0.25, None, 0.5]
    for n, reward in enumerate(rewards, start=1):
        writer.write(
            n, n - 1, lag_report(10.0**-n, 1 + n / 10, {"0": (10.0**-n, 1 + n / 10)}), {}, reward_mean=reward
        )
    page = serve(tmp_path).get("/steps").text
    assert page.count('data-chart="') == 3
    assert page.count('data-series="mean reward"') == 1
    assert 'data-step="1" data-value="0.25"' in page and 'data-step="3" data-value="0.5"' in page
    assert 'data-step="2" data-value="0.01"' in page  # k3 of step 2
    assert "train step" in page and "no value recorded" not in page


def test_a_data_dir_without_steps_shows_no_chart(tmp_path: Path) -> None:
    (tmp_path / ARCHIVE_NAME).write_text("")
    page = serve(tmp_path).get("/steps").text
    assert "data-chart" not in page and "No train step recorded" in page
