"""A small multi-turn tool-use environment: arithmetic with a calculator tool.

Each task asks for the value of an expression. The model may call the ``calculator``
tool (the environment evaluates the expression and answers with a tool message) and
should finish with the number. An answer without a tool call and without the right
number gets a nudge as the next user turn, until the turn budget is spent. The
reward is 1.0 when the final assistant message states the right value; a wrong number
earns partial credit, ``0.1 / (1 + |number - value|)`` (a small model rarely gets the
value, and GRPO learns nothing from a group whose rewards are all equal); no number, 0.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from stages.envs.digits import digit_share

PARTIAL_CREDIT = 0.1
"""The most a final answer that states a wrong number earns (less the farther off it is)."""
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then state the result."
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
NUDGE = "Please use the calculator tool, then give the final number."
RewardKind = Literal["answer", "digits"]
"""How an episode is scored: its final answer (partial credit for a wrong number), or the
share of digits in its replies (``stages.envs.digits``: dense, for showing that a loop learns)."""

_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic."""


def evaluate(expression: str) -> float:
    """Evaluate + - * / and parentheses over numbers; nothing else is accepted."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and type(node.value) is not bool
    ):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return float(_OPERATORS[type(node.op)](left, right))
    raise CalculatorError(f"unsupported element {type(node).__name__}")


@dataclass(frozen=True, slots=True)
class Task:
    task_id: str
    expression: str
    reward: RewardKind = "answer"

    @property
    def answer(self) -> float:
        return evaluate(self.expression)

    def prompt(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {self.expression}?"},
        ]


_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TaskFileError(ValueError):
    """A line of a tasks file that cannot be played; the message names the line and field."""


def read_tasks(lines: Iterable[str], source: str = "tasks") -> list[Task]:
    """Tasks from JSON lines ``{"task_id": ..., "expression": ...}``, each checked: the id
    becomes part of rollout ids, and the expression must evaluate."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TaskFileError(f"{where}: expected an object with task_id and expression")
        task_id, expression = record.get("task_id"), record.get("expression")
        if not isinstance(task_id, str) or not _TASK_ID.match(task_id) or task_id in seen:
            raise TaskFileError(f"{where}: task_id: a new id of letters, digits, '.', '_' or '-' is needed")
        if not isinstance(expression, str):
            raise TaskFileError(f"{where}: expression: a string is needed")
        try:
            evaluate(expression)
        except CalculatorError as exc:
            raise TaskFileError(f"{where}: expression: {exc}") from None
        seen.add(task_id)
        tasks.append(Task(task_id, expression))
    if not tasks:
        raise TaskFileError(f"{source}: no task")
    return tasks


def make_tasks(count: int, seed: int = 0, reward: RewardKind = "answer") -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(count):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        tasks.append(Task(f"t{seed}-{i}", f"({a} {op1} {b}) {op2} {c}", reward))
    return tasks


@dataclass(slots=True)
class Episode:
    """One rollout of a task: the conversation so far and whether it is over."""

    task: Task
    max_turns: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    tool_calls: int = 0

    def __post_init__(self) -> None:
        self.messages = self.task.prompt()

    def step(self, assistant: dict[str, Any]) -> None:
        """Record the assistant's message and add the environment's answer, if any."""
        self.turns += 1
        self.messages.append(_clean(assistant))
        calls = assistant.get("tool_calls") or []
        if calls:
            for call in calls:
                self.tool_calls += 1
                self.messages.append(
                    {"role": "tool", "tool_call_id": call.get("id", ""), "content": _run_tool(call)}
                )
        elif self.task.reward == "digits" or self._correct(assistant.get("content") or ""):
            self.done = True
        else:
            self.messages.append({"role": "user", "content": NUDGE})
        if self.turns >= self.max_turns:
            self.done = True

    def reward(self) -> float:
        finals = [m for m in self.messages if m["role"] == "assistant"]
        if self.task.reward == "digits":
            return digit_share(m.get("content") or "" for m in finals)
        text = finals[-1].get("content") or "" if finals else ""
        if self._correct(text):
            return 1.0
        numbers = _NUMBER.findall(text)
        return PARTIAL_CREDIT / (1 + abs(float(numbers[-1]) - self.task.answer)) if numbers else 0.0

    def _correct(self, text: str) -> bool:
        numbers = _NUMBER.findall(text)
        return bool(numbers) and abs(float(numbers[-1]) - self.task.answer) < 1e-6


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    keep = {"role", "content", "tool_calls", "reasoning_content"}
    return {k: v for k, v in message.items() if k in keep and v is not None}


def _run_tool(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    if function.get("name") != "calculator":
        return json.dumps({"error": f"unknown tool {function.get('name')!r}"})
    try:
        arguments = function.get("arguments") or "{}"
        expression = (json.loads(arguments) if isinstance(arguments, str) else arguments)["expression"]
        return json.dumps({"result": evaluate(str(expression))})
    except (CalculatorError, KeyError, TypeError, ValueError) as exc:
        return json.dumps({"error": str(exc)})
