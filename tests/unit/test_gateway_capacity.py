"""A worker's learned capacity: more slots while its tokens stay fast, half when they slow."""

from __future__ import annotations

import pytest

from pipeline.gateway.capacity import LearnedCapacity, next_limit


def test_a_full_batch_still_fast_adds_a_slot() -> None:
    assert next_limit(4, batch=4, per_token_s=0.012, fastest_s=0.01, tolerance=0.5) == 5


def test_a_batch_below_the_limit_teaches_nothing_new_when_fast() -> None:
    assert next_limit(4, batch=2, per_token_s=0.01, fastest_s=0.01, tolerance=0.5) == 4


def test_a_slow_call_halves_the_limit_but_never_below_one() -> None:
    assert next_limit(8, batch=8, per_token_s=0.016, fastest_s=0.01, tolerance=0.5) == 4
    assert next_limit(1, batch=3, per_token_s=0.05, fastest_s=0.01, tolerance=0.5) == 1


def test_an_engine_that_batches_for_free_grows_the_limit_with_demand() -> None:
    """A GPU-like engine: every call takes 10 ms a token at any batch."""
    capacity = LearnedCapacity()
    for _ in range(20):
        number = capacity.granted()
        capacity.observe(number=number, batch=capacity.limit, seconds=0.16, tokens=16)
    assert capacity.limit == 21


def test_an_engine_that_slows_with_the_batch_settles_at_its_knee() -> None:
    """A CPU-like engine: a token takes 10 ms times the batch; within 1.5x only at batch 1."""
    capacity = LearnedCapacity()
    limits = []
    for _ in range(30):
        batch = capacity.limit
        number = capacity.granted()
        capacity.observe(number=number, batch=batch, seconds=0.01 * batch * 16, tokens=16)
        limits.append(capacity.limit)
    assert max(limits[5:]) <= 2 and capacity.fastest_s == pytest.approx(0.01)


def test_one_cut_per_round_calls_granted_before_it_do_not_cut_again() -> None:
    capacity = LearnedCapacity(limit=8)
    numbers = [capacity.granted() for _ in range(8)]
    capacity.observe(number=numbers[0], batch=1, seconds=0.01, tokens=1)  # the reference
    for number in numbers[1:]:
        capacity.observe(number=number, batch=8, seconds=0.05, tokens=1)
    assert capacity.limit == 4  # one halving for the whole round
    capacity.observe(number=capacity.granted(), batch=8, seconds=0.05, tokens=1)
    assert capacity.limit == 2  # a call of the next round cuts again


def test_a_call_without_tokens_teaches_nothing() -> None:
    capacity = LearnedCapacity(limit=3)
    capacity.observe(number=capacity.granted(), batch=3, seconds=1.0, tokens=0)
    assert capacity.limit == 3 and capacity.fastest_s is None


@pytest.mark.parametrize(("field", "value"), [("limit", 0), ("tolerance", 0.0)])
def test_bad_settings_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        LearnedCapacity(**{field: value})
