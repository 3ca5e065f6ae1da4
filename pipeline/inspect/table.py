"""The rollout table: one row per rollout, filtered, searched, sorted and paged on the server.

Rows are built once from the seals and finalized events; each sort order is computed
the first time it is asked for and kept, so a page of 100,000 rollouts costs one filter
pass and a slice, not a sort per request.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stages.trainer.advantages import group_advantages
from topics.records import FinalizedEvent, RolloutSeal

STATUSES = ("accepted", "rejected", "unfinalized")
"""``unfinalized``: sealed (or only admitted) but no finalized event in the log."""
PER_PAGE = 50
MAX_PER_PAGE = 500
RUN_PREFIX = re.compile(r"^(run-\d{8}-\d{6}-[0-9a-f]{6})\.")
"""``tokentrail run`` names each rollout ``RUN_ID.TASK.MEMBER`` (``pipeline.run.config``)."""


@dataclass(frozen=True, slots=True)
class RolloutRow:
    """What the table shows of one rollout (token-free: from events only)."""

    rollout_id: str
    run_id: str | None
    group_id: str | None
    status: str
    failure_code: str | None
    reward: float | None
    calls: int | None
    tokens: int | None
    min_version: int | None
    max_version: int | None
    sample_policy: str
    sample_keys: tuple[str, ...]

    @property
    def versions(self) -> str:
        if self.min_version is None:
            return "-"
        if self.min_version == self.max_version:
            return str(self.min_version)
        return f"{self.min_version}–{self.max_version}"


def rollout_row(rollout_id: str, seal: RolloutSeal | None, event: FinalizedEvent | None) -> RolloutRow:
    """A row from what the log holds of a rollout: its seal, its finalized event, or both."""
    match = RUN_PREFIX.match(rollout_id)
    policy = event.sample_policy if event else seal.sample_policy if seal else "terminal"
    return RolloutRow(
        rollout_id=rollout_id,
        run_id=match.group(1) if match else None,
        group_id=(event.group_id if event else None) or (seal.group_id if seal else None),
        status=event.status if event else "unfinalized",
        failure_code=event.rejection_reason if event else None,
        reward=event.reward if event and event.reward is not None else seal.reward if seal else None,
        calls=event.call_count if event else None,
        tokens=event.total_len if event else None,
        min_version=event.min_weight_version if event else None,
        max_version=event.max_weight_version if event else None,
        sample_policy=policy,
        sample_keys=tuple(event.sample_keys) if event else (),
    )


def member_advantages(members: Sequence[RolloutRow]) -> dict[str, float]:
    """Rollout id → GRPO advantage of each accepted member, by the trainer's own function.

    The trainer's batch normalizes over samples, so a member counts once per accepted
    sample (every chain of a multi-sample rollout, each with the rollout's reward); its
    samples share one advantage. Rejected members have none.
    """
    accepted = [
        (m.rollout_id, m.reward, max(1, len(m.sample_keys))) for m in members if m.status == "accepted"
    ]
    advantages = group_advantages([reward for _, reward, n in accepted for _ in range(n)])
    out: dict[str, float] = {}
    position = 0
    for rollout_id, _, n in accepted:
        out[rollout_id] = advantages[position]
        position += n
    return out


def _numeric(value: float | int | None) -> tuple[bool, float]:
    return (value is None, -math.inf if value is None else float(value))


SORTS: dict[str, Callable[[RolloutRow], Any]] = {
    "rollout": lambda row: row.rollout_id,
    "group": lambda row: (row.group_id or "", row.rollout_id),
    "status": lambda row: (row.status, row.failure_code or "", row.rollout_id),
    "reward": lambda row: (_numeric(row.reward), row.rollout_id),
    "calls": lambda row: (_numeric(row.calls), row.rollout_id),
    "tokens": lambda row: (_numeric(row.tokens), row.rollout_id),
}


@dataclass(frozen=True, slots=True)
class TableQuery:
    """One request for the table; ``normalized`` clamps what a URL may say."""

    status: str | None = None
    search: str = ""
    sort: str = "rollout"
    descending: bool = False
    page: int = 1
    per_page: int = PER_PAGE

    def normalized(self) -> TableQuery:
        return replace(
            self,
            status=self.status if self.status in STATUSES else None,
            search=self.search.strip(),
            sort=self.sort if self.sort in SORTS else "rollout",
            page=max(1, self.page),
            per_page=min(MAX_PER_PAGE, max(1, self.per_page)),
        )


@dataclass(frozen=True, slots=True)
class TablePage:
    rows: list[RolloutRow]
    matching: int
    """Rows that pass the filter and search, over every page."""
    query: TableQuery

    @property
    def pages(self) -> int:
        return max(1, -(-self.matching // self.query.per_page))


class RolloutTable:
    """Every rollout of the log, by id, and pages of them."""

    def __init__(self, rows: Iterable[RolloutRow]) -> None:
        self._by_id = {row.rollout_id: row for row in rows}
        self._orders: dict[str, list[RolloutRow]] = {}

    @classmethod
    def from_log(
        cls, seals: Mapping[str, RolloutSeal], finalized: Mapping[str, FinalizedEvent]
    ) -> RolloutTable:
        ids = seals.keys() | finalized.keys()
        return cls(rollout_row(rid, seals.get(rid), finalized.get(rid)) for rid in ids)

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, rollout_id: str) -> RolloutRow | None:
        return self._by_id.get(rollout_id)

    def statuses(self) -> Counter[str]:
        return Counter(row.status for row in self._by_id.values())

    def failure_codes(self) -> Counter[str]:
        return Counter(row.failure_code for row in self._by_id.values() if row.failure_code)

    def group(self, group_id: str) -> list[RolloutRow]:
        return [row for row in self._ordered("rollout") if row.group_id == group_id]

    def page(self, query: TableQuery) -> TablePage:
        query = query.normalized()
        rows = self._ordered(query.sort)
        if query.descending:
            rows = rows[::-1]
        if query.status is not None:
            rows = [row for row in rows if row.status == query.status]
        if query.search:
            needle = query.search.lower()
            rows = [row for row in rows if needle in row.rollout_id.lower()]
        start = (query.page - 1) * query.per_page
        return TablePage(rows[start : start + query.per_page], len(rows), query)

    def _ordered(self, sort: str) -> list[RolloutRow]:
        if sort not in self._orders:
            self._orders[sort] = sorted(self._by_id.values(), key=SORTS[sort])
        return self._orders[sort]
