"""Pacing admissions: what it admits, and that a trainer in admission order never sees more
than ``max_staleness`` versions of lag, whatever the interleaving."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.gateway.pacing import Pacing, optional_pacing
from stages.trainer.pacing import Pacer, admissible


@pytest.mark.parametrize(
    ("index", "version", "allowed"),
    [
        (0, 0, True),  # K=1, B=4: versions 0 and 1 may both be produced before the first step
        (7, 0, True),
        (8, 0, False),
        (8, 1, True),
        (11, 1, True),
        (12, 1, False),
    ],
)
def test_admissible_bounds_production_by_the_policy_version(index: int, version: int, allowed: bool) -> None:
    assert admissible(index, version, max_staleness=1, rollouts_per_step=4) is allowed


def test_the_pacer_counts_admissions_and_holds_from_its_first_version() -> None:
    pacer = Pacer(max_staleness=0, rollouts_per_step=2)
    assert pacer.admit(5) and pacer.admit(5)  # the first admission fixes the base at version 5
    assert not pacer.admit(5) and not pacer.may_admit(5)
    assert (pacer.admitted, pacer.held, pacer.base_version) == (2, 1, 5)  # may_admit counts nothing
    assert pacer.admit(6) and pacer.admit(6) and not pacer.admit(6)
    assert (pacer.admitted, pacer.held) == (4, 2)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"max_staleness": -1}, "max_staleness"), ({"rollouts_per_step": 0}, "rollouts_per_step")],
)
def test_bad_settings_are_refused_naming_the_field(fields: dict[str, Any], named: str) -> None:
    settings = {"max_staleness": 1, "rollouts_per_step": 4, **fields}
    with pytest.raises(ValueError, match=named):
        Pacer(**settings)


@given(
    max_staleness=st.integers(0, 3),
    per_step=st.integers(1, 5),
    steps=st.integers(1, 6),
    choices=st.lists(st.booleans(), max_size=200),
)
def test_a_trainer_in_admission_order_never_sees_more_than_max_staleness(
    max_staleness: int, per_step: int, steps: int, choices: list[bool]
) -> None:
    """Admissions and train steps interleave as ``choices`` say (True: try to admit; a
    step takes the next ``per_step`` admissions once they exist); the trainer is never
    starved by pacing, and what it trains is at most ``max_staleness`` behind."""
    pacer = Pacer(max_staleness=max_staleness, rollouts_per_step=per_step)
    admitted_at: list[int] = []
    version = 0
    moves = iter(choices)
    while version < steps:
        batch_ready = len(admitted_at) >= (version + 1) * per_step
        admit = next(moves, not batch_ready)
        if admit:
            if pacer.admit(version):
                admitted_at.append(version)
                continue
            assert batch_ready, f"the pacer starves the trainer at version {version}"
        if batch_ready:  # train step version+1 on its slot, at policy version ``version``
            batch = admitted_at[version * per_step : (version + 1) * per_step]
            assert all(version - born <= max_staleness for born in batch), (version, batch)
            version += 1
    assert len(admitted_at) <= (steps + max_staleness) * per_step


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ((1, None), "rollouts-per-step"),
        ((None, 4), "max-staleness"),
        ((-1, 4), "max_staleness"),
        ((1, 0), "rollouts_per_step"),
    ],
)
def test_the_gateways_pacing_flags_come_together_and_are_checked(
    flags: tuple[int | None, int | None], named: str
) -> None:
    with pytest.raises(ValueError, match=f"^{named}:"):
        optional_pacing(*flags)


def test_the_gateway_paces_only_when_asked_and_tells_a_whole_retry_after() -> None:
    assert optional_pacing(None, None) is None
    pacing = optional_pacing(0, 8)
    assert pacing is not None and (pacing.max_staleness, pacing.rollouts_per_step) == (0, 8)
    assert Pacing(max_staleness=0, rollouts_per_step=1, retry_after_s=0.2).retry_after == "1"
    assert Pacing(max_staleness=0, rollouts_per_step=1, retry_after_s=2.5).retry_after == "3"
    with pytest.raises(ValueError, match=r"^refresh_s:"):
        Pacing(max_staleness=0, rollouts_per_step=1, refresh_s=0)
