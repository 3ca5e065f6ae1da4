"""What the inspector's tests share: the data directory of a real run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunDir:
    path: Path
    run_id: str
    summary: dict[str, object]
    extra: dict[str, str]
    """Suffix → rollout id of the rollouts played after the run."""
    call_ids: dict[str, dict[str, str]]
    """Rollout id → scenario node → call id."""
