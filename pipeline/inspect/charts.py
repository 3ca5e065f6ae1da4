"""Line charts of a run's train steps, as geometry an inline SVG draws (``/steps``).

The inspector renders on the server with no script build, so a chart is computed here
from the step records (each series' values, one per step) and drawn by a template
macro (``templates/charts.html``): every point keeps its step and exact value beside its
coordinates, so what a reader hovers is the record, not a value read back off the axis.
A value that is None or not finite is a gap in its line; a chart whose values span
orders of magnitude (k3: ~1e-12 on policy, ~1e-1 with a wrong temperature) is drawn on a
log axis, where a value at or below 0 sits on the axis floor, marked as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.trainer.steplog import StepLog

WIDTH = 560
HEIGHT = 200
MARGIN_LEFT = 64
"""Room for the y tick labels and the axis label."""
MARGIN_RIGHT = 16
MARGIN_TOP = 10
MARGIN_BOTTOM = 38
"""Room for the step numbers and the x axis label."""
MAX_X_TICKS = 12
Y_TICKS = 5
PALETTE = ("#1b1b1b", "#1f77b4", "#e6550d", "#2ca02c", "#9467bd", "#8c564b", "#d62728", "#7f7f7f")
"""Series colours in order: the run as a whole first (drawn wide and pale beneath the
others, so a lag bucket with the same values stays visible on it), then each lag bucket."""


@dataclass(frozen=True, slots=True)
class Series:
    """One line: a name for the legend and a value per step (None: the step has none)."""

    name: str
    values: Mapping[int, float | None]


@dataclass(frozen=True, slots=True)
class Point:
    step: int
    value: float
    x: float
    y: float
    floor: bool = False
    """On a log axis, a value at or below 0 drawn on the axis floor."""


@dataclass(frozen=True, slots=True)
class Line:
    name: str
    colour: str
    points: list[Point]
    segments: list[list[Point]]
    """Runs of consecutive steps with a value: a missing value breaks the line."""


@dataclass(frozen=True, slots=True)
class Tick:
    value: float
    at: float
    """The pixel coordinate along its axis."""
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    """Everything the template draws: the plot box, the axes' ticks and the lines."""

    key: str
    title: str
    y_label: str
    log: bool
    lines: list[Line]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def left(self) -> int:
        return MARGIN_LEFT

    @property
    def right(self) -> int:
        return self.width - MARGIN_RIGHT

    @property
    def top(self) -> int:
        return MARGIN_TOP

    @property
    def bottom(self) -> int:
        return self.height - MARGIN_BOTTOM

    @property
    def empty(self) -> bool:
        return not any(line.points for line in self.lines)


def finite(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing, not a number, or not finite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def nice_step(span: float, count: int) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about ``count`` ticks."""
    raw = span / max(1, count)
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= raw)


def linear_domain(values: Sequence[float]) -> tuple[float, float, float]:
    """(low, high, tick spacing): round bounds around ``values``; one value, or all equal,
    gets a band around it so the point sits mid-chart instead of on an edge."""
    low, high = min(values), max(values)
    if low == high:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    spacing = nice_step(high - low, Y_TICKS)
    return math.floor(low / spacing) * spacing, math.ceil(high / spacing) * spacing, spacing


def log_domain(values: Sequence[float]) -> tuple[int, int]:
    """(lowest, highest) power of ten around the positive ``values`` (at least one decade)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return -1, 0
    low = math.floor(math.log10(min(positive)))
    high = math.ceil(math.log10(max(positive)))
    return low, max(high, low + 1)


def x_positions(steps: Sequence[int], left: float, right: float) -> dict[int, float]:
    """Each step's x: spread evenly by step number; a single step in the middle."""
    first, last = min(steps), max(steps)
    if first == last:
        return {first: (left + right) / 2}
    return {step: left + (step - first) / (last - first) * (right - left) for step in steps}


def x_ticks(steps: Sequence[int], at: Mapping[int, float]) -> list[Tick]:
    """Every step number, or every k-th (first and last kept) when there are too many to read."""
    ordered = sorted(steps)
    every = max(1, math.ceil(len(ordered) / MAX_X_TICKS))
    shown = ordered[::every]
    if shown[-1] != ordered[-1]:
        shown.append(ordered[-1])
    return [Tick(step, at[step], str(step)) for step in shown]


def line_chart(key: str, title: str, y_label: str, series: Sequence[Series], *, log: bool = False) -> Chart:
    """The chart of ``series`` over the steps any of them names; ``log``: a log y axis."""
    chart = Chart(key, title, y_label, log, [], [], [])
    steps = sorted({step for s in series for step in s.values})
    if not steps:
        return chart
    at = x_positions(steps, chart.left, chart.right)
    values = [v for s in series for v in map(finite, s.values.values()) if v is not None]
    ticks: list[tuple[float, float, str]]  # (position on the axis, value, label)
    if log:
        low_power, high_power = log_domain(values)
        every = max(1, math.ceil((high_power - low_power) / Y_TICKS))
        high_power = low_power + math.ceil((high_power - low_power) / every) * every  # a tick on top
        low, high = float(low_power), float(high_power)
        ticks = [(float(p), 10.0**p, f"1e{p}") for p in range(low_power, high_power + 1, every)]
    else:
        low, high, spacing = linear_domain(values or [0.0])
        count = round((high - low) / spacing)
        ticks = [
            (low + i * spacing, low + i * spacing, _label(low + i * spacing, spacing))
            for i in range(count + 1)
        ]

    def y(position: float) -> float:
        return chart.bottom - (position - low) / (high - low) * (chart.bottom - chart.top)

    lines = []
    for index, one in enumerate(series):
        points: list[Point] = []
        segments: list[list[Point]] = []
        current: list[Point] = []
        for step in steps:
            value = finite(one.values.get(step))
            if value is None:
                if current:
                    segments.append(current)
                current = []
                continue
            floor = log and value <= 0
            position = low if floor else max(low, math.log10(value)) if log else value
            point = Point(step, value, round(at[step], 2), round(y(position), 2), floor)
            points.append(point)
            current.append(point)
        if current:
            segments.append(current)
        lines.append(Line(one.name, PALETTE[index % len(PALETTE)], points, segments))
    return Chart(
        key,
        title,
        y_label,
        log,
        lines,
        x_ticks(steps, at),
        [Tick(value, round(y(position), 2), label) for position, value, label in ticks],
    )


def _label(value: float, spacing: float) -> str:
    """A tick label with as many decimals as the spacing needs (and no ``-0``)."""
    decimals = max(0, -math.floor(math.log10(spacing))) if spacing < 1 else 0
    text = f"{value:.{decimals}f}"
    return "0" if float(text) == 0 else text


def lag_buckets(reports: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every lag bucket the reports have, in lag order."""
    keys = {key for report in reports for key in (report.get("buckets") or {}).get("lag") or {}}
    return sorted(keys, key=int)


def step_charts(steps: Sequence[StepLog]) -> list[Chart]:
    """The charts of one run's steps (``StepLog``s): its mean reward per step, and its
    mismatch per step (k3, the largest ratio), over all tokens and by lag bucket."""
    reports = {log.step: log.mismatch for log in steps}
    lags = lag_buckets(reports.values())

    def mismatch(metric: str) -> list[Series]:
        overall = Series("all tokens", {step: report.get(metric) for step, report in reports.items()})
        by_lag = [
            Series(
                f"lag {lag}",
                {
                    step: ((report.get("buckets") or {}).get("lag") or {}).get(lag, {}).get(metric)
                    for step, report in reports.items()
                },
            )
            for lag in lags
        ]
        return [overall, *by_lag]

    return [
        line_chart(
            "reward",
            "Mean reward per step",
            "mean reward",
            [Series("mean reward", {log.step: log.reward_mean for log in steps})],
        ),
        line_chart("k3", "Mismatch per step: k3 (KL estimate)", "k3 (log)", mismatch("k3"), log=True),
        line_chart("ratio_max", "Mismatch per step: largest ratio w", "ratio max", mismatch("ratio_max")),
    ]


def run_charts(steps: Iterable[StepLog]) -> dict[str, list[Chart]]:
    """Each run's charts, by run id: two runs' steps share numbers, never a chart."""
    by_run: dict[str, list[StepLog]] = {}
    for log in steps:
        by_run.setdefault(log.run_id, []).append(log)
    return {run_id: step_charts(logs) for run_id, logs in by_run.items()}


__all__ = [
    "Chart",
    "Line",
    "Point",
    "Series",
    "Tick",
    "finite",
    "lag_buckets",
    "line_chart",
    "linear_domain",
    "log_domain",
    "nice_step",
    "run_charts",
    "step_charts",
    "x_positions",
    "x_ticks",
]
