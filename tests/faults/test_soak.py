"""Soak: sustained load on the pipeline as separate processes; memory must not grow with
finished rollouts, lag must stay bounded and return to 0.

``--soak-seconds`` sets the length (CI: a minute; ``tokentrail bench soak`` is the long
one). Every bound of the stages is small here: they remember a few hundred answered
rollouts, the ledger keeps the call ids of about as many closed ones, and the finalizer
keeps copies of about as many samples (nobody consumes them, DESIGN §7.4), so that
their bounded memory is full early and any growth after that is a leak. Every sample
(time, rollouts finished, lag, resident memory of each stage) is printed, and a summary
goes to the fault table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from faultkit import check, events_on, group_lags, running_cluster

from bench.soak import slope

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.dataplane]

SAMPLE_EVERY_S = 5.0
REMEMBER = 300
RETAIN_BYTES = 512 * 1024
"""About 200 of the load's samples: the copies' budget fills in the first third."""
CLOSED_BUDGET_MIB = 0.125
"""About 400 closed rollouts' call ids: the ledger's budget fills in the first third."""
GROWTH_LIMIT_MIB = 12.0
"""Allowed resident growth of a stage from a third of the run to its end: allocator noise,
well under what keeping anything per finished rollout would cost over the run."""
SLOPE_LIMIT_MIB_PER_10K = 10.0
"""A stage's resident memory over finished rollouts past a third of the run, least
squares: 1 KB a rollout fails it. A minute resolves no finer (a run's samples jitter by
about 0.5 MiB); ``tokentrail bench soak`` measures the slope over hours."""


@dataclass(frozen=True)
class Sample:
    at_s: float
    finished: int
    lag: dict[str, int]
    rss_mib: dict[str, float]


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@pytest.mark.timeout(900)
def test_memory_stays_flat_under_sustained_load(
    tmp_path: Path, soak_seconds: float, fault_report: object
) -> None:
    samples: list[Sample] = []
    with running_cluster(
        tmp_path, 99, remember=REMEMBER, retain_bytes=RETAIN_BYTES, closed_budget_mib=CLOSED_BUDGET_MIB
    ) as cluster:
        began = time.monotonic()
        while time.monotonic() - began < soak_seconds:
            cluster.supervise(SAMPLE_EVERY_S)
            samples.append(
                Sample(
                    at_s=time.monotonic() - began,
                    finished=events_on(cluster.kafka, cluster.names.finalized),
                    lag=group_lags(cluster.kafka),
                    rss_mib={name: _rss_mib(cluster.procs[name].pid) for name in ("ledger", "finalizer")},
                )
            )
        restarts = {name: proc.restarts for name, proc in cluster.procs.items() if proc.restarts}
        cluster.drain()
        verdict = check(cluster)
    for s in samples:
        print(f"{s.at_s:6.1f}s finished {s.finished:6d} lag {s.lag} rss MiB {s.rss_mib}")
    assert restarts == {}, f"processes died under plain load: {restarts}"
    assert verdict.problems == [], "\n".join(verdict.problems[:20])
    third = samples[len(samples) // 3]
    last = samples[-1]
    finished = last.finished - third.finished
    assert third.finished > REMEMBER and finished > REMEMBER, (
        "too little load to fill the stages' bounded memory"
    )
    growth = {name: last.rss_mib[name] - third.rss_mib[name] for name in last.rss_mib}
    assert all(g < GROWTH_LIMIT_MIB for g in growth.values()), f"memory grew with finished rollouts: {growth}"
    steady = samples[len(samples) // 3 :]
    slopes = {
        name: 10_000 * (slope([s.finished for s in steady], [s.rss_mib[name] for s in steady]) or 0.0)
        for name in last.rss_mib
    }
    assert all(m < SLOPE_LIMIT_MIB_PER_10K for m in slopes.values()), f"memory keeps growing: {slopes}"
    rate = finished / (last.at_s - third.at_s)
    max_lag = max(max(s.lag.values()) for s in samples)
    for name, g in growth.items():
        fault_report.record(  # type: ignore[attr-defined]
            "soak",
            f"{name} memory, {soak_seconds:g}s",
            injected=finished,
            survived=finished,
            outcome=(
                f"RSS {third.rss_mib[name]:.0f} → {last.rss_mib[name]:.0f} MiB ({g:+.1f}; "
                f"{slopes[name]:+.1f} MiB per 10,000 rollouts) over {finished} finished rollouts at "
                f"{rate:.0f}/s; max lag {max_lag} events, 0 after drain"
            ),
        )
