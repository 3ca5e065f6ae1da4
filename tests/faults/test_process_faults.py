"""Faults injected into the pipeline running as separate processes; every rollout accounted for.

Per seed, every fault of ``faultkit.FAULTS`` is injected once, in a seed-dependent order
and at seed-dependent times, while a worker plays rollouts (every 11th with a corrupted
row). Then the load stops, the pipeline drains, and every invariant is checked. The
broker kill runs on its own, on a durable broker under a light load.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from faultkit import BROKER_KILL, FAULTS, Cluster, Verdict, check, running_cluster, schedule

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.dataplane]

WHAT_HAPPENS = {
    "ledger killed": "restarted; replays whole rollouts from its commit point, recalls answered ones",
    "finalizer killed": "restarted; replayed receipts give the same outcome",
    "worker killed between reply and staging": "its open rollouts closed as never_sealed",
    "worker killed mid-batch": "rows written, events lost: rollouts closed as never_sealed, rows deleted",
    BROKER_KILL: "restarted on its store; clients reconnect or are restarted, nothing re-decided",
    "data plane stops answering": "writes fail as capture_failed; the finalizer crashes, restarts, retries",
    "data-plane owner killed": (
        "workers and the finalizer re-attach; workers stage the rows they hold again, the finalizer "
        "puts back the samples nobody acknowledged: no row or sample lost"
    ),
    "segment delivered twice, reordered": "duplicates dropped as late; no second outcome",
}


@pytest.mark.timeout(600)
def test_every_rollout_accounted_for_under_faults(
    fault_seed: int, tmp_path: Path, fault_report: object
) -> None:
    plan = schedule(fault_seed)
    rng = random.Random(fault_seed)
    with running_cluster(tmp_path, fault_seed) as cluster:
        began = time.monotonic()
        for at, fault in plan:
            cluster.supervise(max(0.0, at - (time.monotonic() - began)))
            cluster.inject(fault, rng)
        verdict = settle_and_check(cluster)
    assert sorted(cluster.injected) == sorted(FAULTS)
    assert verdict.outcomes["missing_row"] == 0  # the owner kill lost no row: workers held them
    assert (
        verdict.corrupted > 0
        and verdict.outcomes["digest_mismatch"] + verdict.outcomes["chain_hash_mismatch"] > 0
    )
    report(fault_report, cluster, verdict, f"seed {fault_seed}")


@pytest.mark.timeout(600)
def test_a_killed_durable_broker_loses_nothing(tmp_path: Path, fault_report: object) -> None:
    rng = random.Random(0)
    # The ledger's clocks run while the broker is down; a longer --max-open keeps the outage
    # from closing rollouts whose events are only delayed (see the README's known limits).
    options = {"storage": "durable", "concurrency": 2, "think_s": 0.4, "max_open_s": 30.0}
    with running_cluster(tmp_path, 0, **options) as cluster:
        cluster.supervise(4.0)
        cluster.inject(BROKER_KILL, rng)
        cluster.supervise(6.0)
        verdict = settle_and_check(cluster)
    assert verdict.outcomes["accepted"] > 0
    report(fault_report, cluster, verdict, "durable broker")


def settle_and_check(cluster: Cluster) -> Verdict:
    cluster.wait_progress(20)  # load after the last fault: samples written since any data-plane restart
    cluster.drain()
    verdict = check(cluster)
    assert verdict.problems == [], "\n".join(verdict.problems[:40])
    assert verdict.samples_checked > 0
    assert verdict.samples_lost_with_dataplane == 0  # the finalizer kept copies until the restart
    return verdict


def report(fault_report: object, cluster: Cluster, verdict: Verdict, run: str) -> None:
    restarts = {name: proc.restarts for name, proc in cluster.procs.items() if proc.restarts}
    for fault, count in cluster.injected.items():
        fault_report.record(
            "faults survived", fault, injected=count, survived=count, outcome=WHAT_HAPPENS[fault]
        )  # type: ignore[attr-defined]
    fault_report.record(  # type: ignore[attr-defined]
        "fault runs",
        run,
        injected=sum(cluster.injected.values()),
        survived=sum(cluster.injected.values()),
        outcome=(
            f"{verdict.summary()}; {verdict.samples_checked} samples equal the engine's tokens; "
            f"{verdict.samples_lost_with_dataplane} unread samples lost with the data plane; "
            f"restarts after exits {restarts or 'none'}"
        ),
    )
