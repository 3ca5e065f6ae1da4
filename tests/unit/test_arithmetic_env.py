"""The arithmetic tool-use environment: calculator safety, turns, reward."""

from __future__ import annotations

import json

import pytest

from stages.envs.arithmetic import (
    PARTIAL_CREDIT,
    CalculatorError,
    Episode,
    Task,
    TaskFileError,
    evaluate,
    make_tasks,
    read_tasks,
)


def test_calculator_evaluates_arithmetic_only() -> None:
    assert evaluate("(2 + 3) * 4 - 6 / 3") == 18.0
    assert evaluate("-5 * 2") == -10.0
    for bad in ("__import__('os')", "2 ** 10", "a + 1", "1 / 0", "1 +"):
        with pytest.raises(CalculatorError):
            evaluate(bad)


def test_tool_call_then_answer_earns_reward() -> None:
    episode = Episode(Task("t", "(2 + 3) * 4"), max_turns=3)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "(2 + 3) * 4"})},
    }
    episode.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert json.loads(episode.messages[-1]["content"]) == {"result": 20.0}
    assert not episode.done
    episode.step({"role": "assistant", "content": "The answer is 20."})
    assert episode.done and episode.reward() == 1.0 and episode.turns == 2


def test_wrong_answers_get_nudged_until_turns_run_out() -> None:
    episode = Episode(Task("t", "1 + 1"), max_turns=2)
    episode.step({"role": "assistant", "content": "3"})
    assert episode.messages[-1]["role"] == "user" and not episode.done
    episode.step({"role": "assistant", "content": "hmm"})
    assert episode.done and episode.reward() == 0.0


def test_a_wrong_number_earns_less_credit_the_farther_off_it_is() -> None:
    rewards = []
    for said in ("It is 3.", "It is 12."):
        episode = Episode(Task("t", "1 + 1"), max_turns=1)
        episode.step({"role": "assistant", "content": said})
        rewards.append(episode.reward())
    assert rewards == [PARTIAL_CREDIT / 2, PARTIAL_CREDIT / 11]


def test_bad_tool_arguments_answer_with_an_error() -> None:
    episode = Episode(Task("t", "1 + 1"), max_turns=3)
    episode.step(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "x", "function": {"name": "calculator", "arguments": "{not json"}}],
        }
    )
    assert "error" in json.loads(episode.messages[-1]["content"])


def test_tasks_are_deterministic() -> None:
    assert make_tasks(5, seed=3) == make_tasks(5, seed=3)
    assert len({t.task_id for t in make_tasks(50)}) == 50


def test_tasks_are_read_from_json_lines_and_each_bad_line_is_named() -> None:
    good = ['{"task_id": "a1", "expression": "2 + 3"}', "", '{"task_id": "b.2", "expression": "(4 * 5) - 1"}']
    assert [(t.task_id, t.answer) for t in read_tasks(good)] == [("a1", 5.0), ("b.2", 19.0)]
    bad = {
        "not json": "tasks:1: not JSON",
        '{"task_id": "a/1", "expression": "1"}': "tasks:1: task_id",
        '{"task_id": "a", "expression": 7}': "tasks:1: expression",
        '{"task_id": "a", "expression": "import os"}': "tasks:1: expression",
        "[1, 2]": "tasks:1: expected an object",
    }
    for line, message in bad.items():
        with pytest.raises(TaskFileError, match=message):
            read_tasks([line])
    with pytest.raises(TaskFileError, match="tasks:2: task_id"):
        read_tasks(['{"task_id": "a", "expression": "1"}', '{"task_id": "a", "expression": "2"}'])
    with pytest.raises(TaskFileError, match="no task"):
        read_tasks([""])


def test_the_digits_reward_is_the_share_of_digits_in_the_replies_and_ends_at_the_first() -> None:
    episode = Episode(Task("t", "1 + 1", reward="digits"), max_turns=3)
    episode.step({"role": "assistant", "content": "ab 12"})
    assert episode.done  # no nudge: every reply is scored as it stands
    assert episode.reward() == pytest.approx(0.5)  # blanks do not count
    assert Episode(Task("t", "1 + 1", reward="digits"), max_turns=1).reward() == 0.0
    assert {task.reward for task in make_tasks(3, seed=0, reward="digits")} == {"digits"}
