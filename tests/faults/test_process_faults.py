"""Faults injected into the pipeline running as separate processes; every rollout accounted for.

Per seed, every fault of ``faultkit.FAULTS`` is injected once, in a seed-dependent order
and at seed-dependent times, while a worker plays rollouts (every 11th with a corrupted
row). Then the load stops, the pipeline drains, and every invariant is checked.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from faultkit import FAULTS, check, running_cluster, schedule

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.dataplane]

WHAT_HAPPENS = {
    "ledger killed": "restarted; replays whole rollouts from its commit point, recalls answered ones",
    "finalizer killed": "restarted; replayed receipts give the same outcome",
    "worker killed between reply and staging": "its open rollouts closed as never_sealed",
    "worker killed mid-batch": "rows written, events lost: rollouts closed as never_sealed, rows deleted",
    "broker killed (durable)": "restarted on its store; clients reconnect, nothing re-decided",
    "data plane stops answering": "writes fail as capture_failed; the finalizer crashes, restarts, retries",
    "data-plane owner killed": "rows lost: rollouts rejected missing_row; workers restarted",
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
        cluster.supervise(3.0)
        cluster.drain()
        verdict = check(cluster)
        restarts = {name: proc.restarts for name, proc in cluster.procs.items() if proc.restarts}
    assert verdict.problems == [], "\n".join(verdict.problems[:40])
    assert sorted(cluster.injected) == sorted(FAULTS)
    assert verdict.samples_checked > 0
    assert (
        verdict.corrupted > 0
        and verdict.outcomes["digest_mismatch"] + verdict.outcomes["chain_hash_mismatch"] > 0
    )
    for fault, count in cluster.injected.items():
        fault_report.record(
            "faults survived", fault, injected=count, survived=count, outcome=WHAT_HAPPENS[fault]
        )  # type: ignore[attr-defined]
    fault_report.record(  # type: ignore[attr-defined]
        "fault runs",
        f"seed {fault_seed}",
        injected=len(plan),
        survived=len(plan),
        outcome=(
            f"{verdict.summary()}; {verdict.samples_checked} samples equal the engine's tokens; "
            f"{verdict.samples_lost_with_dataplane} unread samples lost with the data plane; "
            f"unplanned restarts {restarts or 'none'}"
        ),
    )
