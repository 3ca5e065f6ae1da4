"""The prefix splice of DESIGN §5 on hand-built renders."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stages.capture import SpliceError, splice_prefix
from topics.failures import WorkerFailure

EOS = 2
ALT_EOS = 3
SYS, USER, ASSIST, THINK = 10, 11, 12, 13


def test_plain_two_turn_splice() -> None:
    # exact: [SYS 20 USER 21 ASSIST] + generated [30 31 EOS]
    exact = [SYS, 20, USER, 21, ASSIST, 30, 31, EOS]
    partial = [SYS, 20, USER, 21, ASSIST, 30, 32, EOS]  # re-render merged tokens differently
    full = [*partial, USER, 22, ASSIST]
    assert splice_prefix(exact, partial, full, [EOS]) == [*exact, USER, 22, ASSIST]


def test_reasoning_stripping_template_shifts_positions_not_counts() -> None:
    turn1 = [USER, 21, ASSIST, THINK, 40, 41, THINK, 30, EOS]
    turn2 = [USER, 22, ASSIST, THINK, 42, THINK, 31, EOS]
    exact = [SYS, *turn1, *turn2]
    # the template drops the reasoning of earlier assistant turns on re-render
    partial = [SYS, USER, 21, ASSIST, 30, EOS, USER, 22, ASSIST, 31, EOS]
    full = [*partial, USER, 23, ASSIST]
    assert splice_prefix(exact, partial, full, [EOS]) == [*exact, USER, 23, ASSIST]


def test_model_stopped_without_eos_gets_template_eos() -> None:
    exact = [SYS, USER, 21, ASSIST, 30, 31]  # hit max_tokens, no EOS generated
    partial = [SYS, USER, 21, ASSIST, 30, 31, EOS]
    full = [*partial, USER, 22, ASSIST]
    assert splice_prefix(exact, partial, full, [EOS]) == [*exact, EOS, USER, 22, ASSIST]


def test_several_eos_ids_keep_the_models_own() -> None:
    exact = [SYS, USER, 21, ASSIST, 30, ALT_EOS]  # the model ended on an alternative EOS
    partial = [SYS, USER, 21, ASSIST, 30, EOS]  # the template closes turns with EOS
    full = [*partial, USER, 22, ASSIST]
    result = splice_prefix(exact, partial, full, [EOS, ALT_EOS])
    assert result == [*exact, USER, 22, ASSIST]
    assert result[len(exact) - 1] == ALT_EOS


def test_eos_in_system_prompt_is_counted() -> None:
    exact = [SYS, EOS, USER, 21, ASSIST, 30, EOS]
    partial = [SYS, EOS, USER, 21, ASSIST, 30, EOS]
    full = [*partial, USER, 22, ASSIST]
    assert splice_prefix(exact, partial, full, [EOS]) == [*exact, USER, 22, ASSIST]


@pytest.mark.parametrize(
    ("partial", "full", "reason"),
    [
        ([SYS, USER, 21, ASSIST, 30, EOS], [SYS, USER, 21, ASSIST, 30, USER, 22], "fewer than 1 EOS"),
        ([SYS, USER, 21, ASSIST, 30], [SYS, USER, 21, ASSIST, 30, EOS, USER], "no EOS"),
        ([SYS, EOS, USER, EOS], [SYS, EOS, USER], "fewer than 2 EOS"),
    ],
)
def test_missing_eos_fails_with_code(partial: list[int], full: list[int], reason: str) -> None:
    with pytest.raises(SpliceError, match=reason) as info:
        splice_prefix([SYS, USER, 21, ASSIST, 30, EOS], partial, full, [EOS])
    assert info.value.code == WorkerFailure.PREFIX_SPLICE_FAILED


def test_empty_inputs_fail() -> None:
    with pytest.raises(SpliceError):
        splice_prefix([], [EOS], [EOS], [EOS])
    with pytest.raises(SpliceError):
        splice_prefix([1, EOS], [EOS], [EOS], [])


tokens = st.lists(st.integers(min_value=4, max_value=50), min_size=1, max_size=8)


@given(st.lists(st.tuples(tokens, tokens, st.booleans()), min_size=1, max_size=4), tokens)
def test_result_always_starts_with_exact_prefix(
    turns: list[tuple[list[int], list[int], bool]], tail: list[int]
) -> None:
    exact: list[int] = []
    partial: list[int] = []
    for user, reply, ends_on_eos in turns:
        exact += [USER, *user, ASSIST, *reply] + ([EOS] if ends_on_eos else [])
        # the re-render always closes a turn with EOS and may re-tokenize the reply
        partial += [USER, *user, ASSIST, *reversed(reply), EOS]
    exact_final_turn_closed = exact[-1] == EOS
    if not all(t[2] for t in turns[:-1]):
        return  # a missing EOS inside the exact prefix is not a shape the engine produces
    result = splice_prefix(exact, partial, [*partial, USER, *tail, ASSIST], [EOS])
    assert result[: len(exact)] == exact
    assert result[-len(tail) - 2 :] == [USER, *tail, ASSIST]
    assert len(result) == len(exact) + (0 if exact_final_turn_closed else 1) + len(tail) + 2


def test_a_history_render_closing_other_turns_than_the_prefix_fails() -> None:
    exact = [SYS, EOS, USER, 21, EOS, ASSIST, 30, EOS]  # three turns closed
    partial = [USER, 21, EOS, ASSIST, 30, EOS]  # the template dropped the system turn
    with pytest.raises(SpliceError, match="closes 2 turns but the exact prefix closes 3"):
        splice_prefix(exact, partial, [*partial, USER, 22, EOS, ASSIST], [EOS])
