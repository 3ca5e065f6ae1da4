"""Rows a worker keeps after staging them, so that a data plane that restarts empty loses none.

The data plane keeps rows in its owner's memory: when the owner dies, every row not yet
finalized is gone. A worker therefore keeps each row it staged until its rollout's
``FinalizedEvent`` says the row is no longer needed, and stages the rows it still holds
again when it attaches to a restarted data plane. Memory is bounded: over the budget the
oldest rows are let go (and counted), so a restart can lose only rows beyond the budget.

A row written after its rollout was finalized (its write was slow, the ledger closed
the rollout without it, or it was staged again after the finalizer's delete) would
stay in the data plane for good: ``add`` and ``release`` return the keys the caller
must delete (deleting a row the finalizer already deleted costs a look-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.capture.by_rollout import ByRollout
from stages.recent import DEFAULT_REMEMBER, RecentIds
from topics.staging import CallRow

DEFAULT_BUDGET_BYTES = 256 * 2**20
ROW_OVERHEAD_BYTES = 1024
"""Identity, hashes and object headers of a row, beyond its token vectors."""


def row_bytes(row: CallRow) -> int:
    """What a row costs to keep: 8 bytes an id, 4 a mask entry, 4 a logprob, plus overhead."""
    return ROW_OVERHEAD_BYTES + 16 * row.delta_len


@dataclass(slots=True)
class RetainedStats:
    held: int = 0
    held_bytes: int = 0
    released: int = 0
    late: int = 0
    """Rows written after their rollout was finalized (deleted, not held)."""
    over_budget: int = 0
    """Rows let go before their rollout was finalized: a data-plane restart loses these."""
    restaged: int = 0


class RetainedRows:
    """Staged rows by key, oldest first, within ``budget_bytes``; the last ``remember``
    finalized rollouts are recognised, so that a row of theirs written late is handed back."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, *, remember: int = DEFAULT_REMEMBER) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.stats = RetainedStats()
        self._rows: ByRollout[CallRow] = ByRollout(lambda row: row.rollout_id, row_bytes)
        self._finalized = RecentIds(remember)

    def add(self, rows: Sequence[CallRow]) -> list[str]:
        """Hold rows just written; returns the keys of those whose rollout is finalized
        already (late: the caller deletes them, nobody else will)."""
        late: list[str] = []
        for row in rows:
            key = row.staging_key
            if row.rollout_id in self._finalized:
                late.append(key)
                self.stats.late += 1
                continue
            self._rows.put(key, row)  # written again: the latest version is the one to keep
        self.stats.over_budget += self._rows.drop_oldest(self.budget_bytes)
        self.stats.held, self.stats.held_bytes = len(self._rows), self._rows.nbytes
        return late

    def release(self, rollout_id: str) -> list[str]:
        """Let go of a finalized rollout's rows; returns their keys, to delete: a copy
        written after the finalizer's own delete would otherwise stay."""
        self._finalized.add(rollout_id)
        keys = self._rows.pop_rollout(rollout_id)
        self.stats.released += len(keys)
        self.stats.held, self.stats.held_bytes = len(self._rows), self._rows.nbytes
        return keys

    def held(self) -> list[CallRow]:
        """Every row still held, oldest first."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)
