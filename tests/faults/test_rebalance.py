"""Two ledger and two finalizer processes under load: a kill -9 of one and a rolling
restart of all lose no rollout and give none two outcomes (``bench.rebalance`` fails
the run otherwise); every rollout published comes out finalized."""

from __future__ import annotations

import pytest

from bench import rebalance

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.dataplane]


def test_stage_instances_lose_and_fork_nothing_when_killed_or_restarted() -> None:
    config = rebalance.RebalanceConfig(
        seconds=8.0, rate=10.0, scenarios=("ledger killed", "finalizer killed", "rolling restart")
    )
    report = rebalance.run(config)
    results = {r["scenario"]: r for r in report["results"]}
    assert list(results) == list(config.scenarios)
    for scenario, result in results.items():
        assert result["rollouts"] == 80, scenario
        assert result["faults"] == (4 if scenario == "rolling restart" else 1), scenario
