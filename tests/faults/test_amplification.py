"""Fail-closed amplification: a lost call that was retried must not cost its rollout.

Runs ``bench.amplification`` small (real capture path, real ledger and finalizer on
in-memory ports; no broker) with a high loss rate, so that both kinds of loss occur
at this size: a lost call retried successfully (a dead branch off the terminal chain)
and an episode that ended on a lost call (its terminal chain was hit). The verdict of
every rollout is checked against the driver's ground truth, by rollout id.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from bench.amplification import LOST, Config, Measurement, measure
from topics.failures import WorkerFailure

# 16 turns at 6% loss per attempt: about 63% of rollouts lose a call, about 6% end on one.
CONFIG = Config(calls=16, fail=0.06, rollouts=200)


class Report(Protocol):
    """The fault suite's ``fault_report`` fixture (tests/faults/conftest.py)."""

    def record(self, section: str, kind: str, *, injected: int, survived: int, outcome: str) -> None: ...


def test_only_a_hit_terminal_chain_rejects(fault_seed: int, fault_report: Report) -> None:
    m: Measurement = asyncio.run(measure(CONFIG, seed=fault_seed))
    fault_report.record(
        "fail-closed amplification",
        CONFIG.label,
        injected=m.failed_calls,
        survived=m.survived,
        outcome=(
            f"rejected {m.share(m.rejected):.1%} (terminal chain hit {m.share(m.terminal_hit):.1%}; "
            f"fail-closed would mask {m.share(m.any_failed):.0%})"
        ),
    )
    outcomes = {o.rollout_id: o for o in m.outcomes}
    hit = {r for r, o in outcomes.items() if o.terminal_hit}
    retried_only = {r for r, o in outcomes.items() if o.failed_calls and not o.terminal_hit}
    # The run exercised both kinds of loss.
    assert len(outcomes) == CONFIG.rollouts
    assert hit, "no episode ended on a lost call: the run does not test rejection"
    assert len(retried_only) > len(hit), "too few retried losses to test the carve-out"
    assert m.failed_calls == sum(len(o.failed_calls) for o in m.outcomes) > 0

    # Every rollout got exactly one verdict, and the staging rows of all are gone.
    assert {o.status for o in m.outcomes} <= {"accepted", "rejected"}
    assert m.rows_left == 0

    # Rejected exactly when the terminal chain was hit.
    rejected = {r for r, o in outcomes.items() if o.status == "rejected"}
    assert sorted(rejected - hit) == [], "rejected although the terminal chain was intact"
    assert sorted(hit - rejected) == [], "accepted although the episode ended on a lost call"

    # A rollout rejected for a lost call says so.
    assert LOST is WorkerFailure.NOT_SERVED
    reasons = {r: outcomes[r].reason for r in rejected}
    assert {r: why for r, why in reasons.items() if why != LOST.value} == {}

    # Accepted samples are exactly the served chain: no span of a lost call, the driver's exact ids.
    for o in m.outcomes:
        if o.status == "accepted":
            assert not set(o.sample_calls) & set(o.failed_calls), o.rollout_id
        assert o.sample_exact, o.rollout_id

    # Retries keep the rejected share far below what fail-closed masks.
    assert m.survived == len(retried_only)
    assert m.share(m.rejected) * 4 < m.share(m.any_failed)
