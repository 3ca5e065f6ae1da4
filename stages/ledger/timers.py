"""Log-time clocks per task, and the rollout deadlines they pass (DESIGN §7.2).

A task is one partition number: partition p of every input topic, where all of a
rollout's events land. Each task keeps its own clock (the latest log time applied in
it), so a partition taken over mid-run, or re-read after a restart from an old commit
point, replays its rollouts against its own time, not against the time other
partitions have reached. Deadlines sit in a heap per task; an entry may be stale (the
rollout closed, or got an earlier deadline), so the caller checks what it pops.

A closed rollout's entries would otherwise stay until their deadline passes: its
``max_open_s`` one (an hour by default) outlives its seal by that long, so at 25
rollouts a second a heap held ~90,000 dead entries (~100 bytes each) and a longer
``--max-open`` held more. So the caller cancels a closed rollout, and once the cancelled
ids reach a quarter of a heap, the heap is rebuilt without them: a heap stays within
four times its live entries, at an amortized constant cost per cancellation.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

COMPACT_AT_LEAST = 64
"""Cancelled ids a task collects before its heap is worth rebuilding, however small."""


@dataclass(slots=True)
class _Task:
    now: float = -math.inf
    deadlines: list[tuple[float, str]] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    """Rollouts whose entries are dead: dropped from the heap at the next rebuild."""

    def compact(self) -> None:
        self.deadlines = [entry for entry in self.deadlines if entry[1] not in self.cancelled]
        heapq.heapify(self.deadlines)
        self.cancelled.clear()


class TaskTimers:
    """Deadlines (log time, rollout id) per task, released as the task's clock passes them."""

    def __init__(self) -> None:
        self._tasks: dict[int, _Task] = {}

    def schedule(self, task: int, at: float, rollout_id: str) -> None:
        state = self._task(task)
        state.cancelled.discard(rollout_id)  # opened again (forgotten as answered): live once more
        heapq.heappush(state.deadlines, (at, rollout_id))

    def cancel(self, task: int, rollout_id: str) -> None:
        """The rollout closed: its entries in ``task``'s heap are dead, and go at the next rebuild."""
        state = self._tasks.get(task)
        if state is None:
            return
        state.cancelled.add(rollout_id)
        if len(state.cancelled) >= max(COMPACT_AT_LEAST, len(state.deadlines) // 4):
            state.compact()

    def entries(self) -> int:
        """Heap entries over every task, dead ones included: what the timers hold."""
        return sum(len(state.deadlines) for state in self._tasks.values())

    def now(self, task: int) -> float:
        state = self._tasks.get(task)
        return state.now if state is not None else -math.inf

    def advance(self, task: int, now: float) -> list[str]:
        """Move ``task``'s clock to ``now`` (never back); the rollouts whose deadline it passed."""
        state = self._task(task)
        state.now = max(state.now, now)
        due: list[str] = []
        while state.deadlines and state.deadlines[0][0] <= state.now:
            due.append(heapq.heappop(state.deadlines)[1])
        return due

    def _task(self, task: int) -> _Task:
        """The task's state, created on first use (``advance`` runs once per event, so
        no throwaway state is built when it exists)."""
        state = self._tasks.get(task)
        if state is None:
            state = self._tasks[task] = _Task()
        return state

    def tasks(self) -> list[int]:
        return list(self._tasks)

    def clocks(self) -> dict[int, float]:
        """Every task's clock: with the open rollouts' events, what a checkpoint needs."""
        return {task: state.now for task, state in self._tasks.items()}

    def forget(self, tasks: Iterable[int]) -> None:
        """Drop the clocks and deadlines of tasks this instance no longer owns."""
        for task in tasks:
            self._tasks.pop(task, None)
